"""The root config: one typed tree for every stage.

Sections live in their own modules (target, data, model, train, eval); this file composes
them and derives artifact paths, so every stage agrees on where the others write.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from deepspec.config.data import CacheConfig, DataConfig
from deepspec.config.eval import EvalConfig, ExportConfig
from deepspec.config.model import ModelConfig
from deepspec.config.target import TargetConfig
from deepspec.config.train import LoggingConfig, TrainConfig
from deepspec.errors import ConfigError


@dataclass
class Config:
    project: str = "deepspec"
    exp: str = "default"
    # Root of data and cache artifacts: <output_root>/<project>/...
    output_root: str = "outputs"
    seed: int = 0
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    # Set by the loader: the --opts used, recorded in run names and config.yaml.
    overrides: list[str] = field(default_factory=list)

    def validate(self) -> None:
        for name in ("project", "exp"):
            value = getattr(self, name)
            if not value or "/" in value:
                raise ConfigError(f"'{name}' must be a non-empty name without '/', got {value!r}.")

    # ------------------------------------------------------------------ artifact paths

    @property
    def project_dir(self) -> Path:
        return Path(self.output_root) / self.project

    @property
    def data_dir(self) -> Path:
        return Path(self.data.dir) if self.data.dir else self.project_dir / "data"

    @property
    def conversations_path(self) -> Path:
        return self.data_dir / "conversations.jsonl"

    @property
    def heldout_path(self) -> Path:
        return self.data_dir / "heldout.jsonl"

    @property
    def regenerated_path(self) -> Path:
        return self.data_dir / "regenerated.jsonl"

    @property
    def regenerated_heldout_path(self) -> Path:
        return self.data_dir / "regenerated.heldout.jsonl"

    @property
    def cache_dir(self) -> Path:
        return Path(self.cache.dir) if self.cache.dir else self.project_dir / "cache"

    @property
    def cache_train_dir(self) -> Path:
        return self.cache_dir / "train"

    @property
    def cache_heldout_dir(self) -> Path:
        return self.cache_dir / "heldout"

    @property
    def run_name(self) -> str:
        """`exp`, plus a readable suffix of the overrides so ablations never overwrite each other."""
        skip = ("train.output_root", "output_root", "eval.", "export.", "logging.")
        parts = [o for o in self.overrides if not o.startswith(skip)]
        if not parts:
            return self.exp
        suffix = "__".join(re.sub(r"[^A-Za-z0-9_.=,-]+", "", p.split(".")[-1]) for p in parts)
        name = f"{self.exp}__{suffix}"
        if len(name) > 120 or any("/" in p for p in parts):
            # Long or path-valued overrides: keep the name readable and unique with a hash of all of them.
            digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:10]
            name = f"{name[:100]}__{digest}"
        return name

    @property
    def run_dir(self) -> Path:
        """Checkpoints of this run: <train.output_root>/<project>/<run_name>/step_N."""
        return Path(self.train.output_root) / self.project / self.run_name
