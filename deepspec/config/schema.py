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
class RunConfig:
    """Which run folder training writes, and whether it may resume with other settings."""

    # The experiment's name: the run folder is <train.output_root>/<project>/<run.name>. null = the recipe's `exp`.
    # Overrides never rename a run: they are recorded in its config.yaml (DeepSpec's exp_name).
    name: str | None = None
    # Resuming a run whose saved settings differ from this one's stops with the differences; true resumes anyway.
    allow_changes: bool = False


@dataclass
class Config:
    project: str = "deepspec"
    # The recipe's default run name (`run.name` wins when set).
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
    run: RunConfig = field(default_factory=RunConfig)
    # Set by the loader: the --opts used, recorded in config.yaml.
    overrides: list[str] = field(default_factory=list)

    def validate(self) -> None:
        for name, value in (("project", self.project), ("exp", self.exp), ("run.name", self.run.name)):
            if value is None and name == "run.name":
                continue
            if not value or "/" in value or value in (".", ".."):
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
        """The run's folder name: `run.name`, else `exp`. Overrides do not rename a run (see `legacy_run_name`)."""
        return self.run.name or self.exp

    @property
    def legacy_run_name(self) -> str:
        """The folder name earlier versions derived from `exp` and the overrides (`eagle3__max_samples=212`), so
        runs started before `run.name` existed are still found and resumed."""
        skip = ("train.output_root", "output_root", "eval.", "export.", "logging.", "run.")
        parts = [o for o in self.overrides if not o.startswith(skip)]
        if not parts:
            return self.exp
        suffix = "__".join(re.sub(r"[^A-Za-z0-9_.=,-]+", "", p.split(".")[-1]) for p in parts)
        name = f"{self.exp}__{suffix}"
        if len(name) > 120 or any("/" in p for p in parts):
            digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:10]
            name = f"{name[:100]}__{digest}"
        return name

    @property
    def run_dir(self) -> Path:
        """Checkpoints of this run: <train.output_root>/<project>/<run_name>/step_N. Without `run.name`, a folder
        named the earlier way (after the overrides) is used when it exists and the new one does not."""
        root = Path(self.train.output_root) / self.project
        new = root / self.run_name
        if self.run.name is None and not new.exists():
            legacy = root / self.legacy_run_name
            if legacy != new and legacy.is_dir():
                return legacy
        return new
