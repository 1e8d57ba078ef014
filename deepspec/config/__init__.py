"""Typed configuration: YAML recipes with `_base_`, validated dataclasses, `--opts` overrides."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from deepspec.config.loader import apply_opts, build_dataclass, load_yaml_with_bases, to_dict
from deepspec.config.schema import Config

__all__ = ["Config", "load_config", "config_from_dict", "save_config", "config_to_dict"]


def config_from_dict(data: dict[str, Any], opts: list[str] | None = None) -> Config:
    """Validate a raw mapping (+ overrides) against the schema."""
    data = apply_opts(data, opts, Config)
    cfg = build_dataclass(Config, data)
    cfg.overrides = list(cfg.overrides) + list(opts or [])
    return cfg


def load_config(path: str | Path | None = None, opts: list[str] | None = None) -> Config:
    """Load a recipe (with its `_base_` chain) and apply `--opts`; `None` = all defaults."""
    data = load_yaml_with_bases(path) if path else {}
    data.pop("overrides", None)
    return config_from_dict(data, opts)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data, secrets (API keys, tokens, URL passwords) replaced by '<redacted>': this is what
    every saved config.yaml, wandb's run config and results.json hold (deepspec/config/secrets.py)."""
    from deepspec.config.secrets import redact

    return redact(to_dict(cfg))


def save_config(cfg: Config, directory: str | Path, name: str = "config.yaml") -> Path:
    """Write the fully resolved config next to an artifact (atomically)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    # one temporary name per process: two runs of one project (ablations side by side) share run_config.yaml
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")
    tmp.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    tmp.replace(path)
    return path
