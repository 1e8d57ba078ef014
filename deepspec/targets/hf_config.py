"""The target's HF config for the processes that need its numbers, not its classes.

A training rank reads a dozen numbers of the target's config (sizes, RoPE, norms, taps) to build its draft and check
its cache. Resolving them through `transformers.AutoConfig` imports transformers and, through the config class, its
model-loading stack: ~1.2 s of a tiny run's 4 s, in every rank of every launch. So the first process that resolves a
target's config on a machine records those numbers (`FIELDS`, read from the real config object: aliases and defaults
included) in deepspec's cache, keyed by the bytes of the target's config.json and the transformers version; later
processes read them back as a `RecordedConfig`. Hub ids, revisions, remote code and deepspec's own tiny model types
always go through AutoConfig.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from deepspec.atomic import write_json_atomic
from deepspec.log import get_logger

log = get_logger(__name__)

# Every attribute of a target config that the training path reads (deepspec/drafts/layers.py arch_from_target, the
# adapters' hc_mult and model type, the taps, train/build.py). Reading any other raises: add it here.
FIELDS = (
    "model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "hidden_act",
    "hidden_activation", "attention_bias", "rope_parameters", "rope_scaling", "rope_theta", "final_logit_softcapping",
    "tie_word_embeddings", "hc_mult",
)
_VERSION = 1  # of the record's layout


class RecordedConfig:
    """The recorded numbers of a target's (text) config. An attribute the real config lacked raises AttributeError, as
    it would there (so `getattr(config, name, default)` behaves alike); one that was never recorded raises LookupError,
    which `getattr` with a default does not swallow."""

    def __init__(self, values: dict[str, Any]):
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:
        if name in FIELDS or name.startswith("__") or name == "text_config":
            raise AttributeError(name)
        raise LookupError(f"the target config field {name!r} is not recorded for training processes; add it to "
                          f"deepspec/targets/hf_config.py FIELDS")

    def __repr__(self) -> str:
        return f"RecordedConfig({self.__dict__})"


def target_config(name: str, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The target's HF config (its text config for a multimodal one): recorded numbers where this machine has resolved
    this config before, else `AutoConfig` (whose numbers are then recorded)."""
    from deepspec.targets.load import resolve_target_path

    path = resolve_target_path(name)
    record = _record_path(Path(path)) if not revision and not trust_remote_code else None
    if record is not None:
        try:
            values = json.loads(record.read_text())
            if values.get("_version") == _VERSION:
                return RecordedConfig({k: v for k, v in values.items() if k in FIELDS})
        except (OSError, ValueError):
            pass
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    config = getattr(config, "text_config", None) or config
    if record is not None:
        _write(record, {"_version": _VERSION, **{k: getattr(config, k) for k in FIELDS if hasattr(config, k)}})
    return config


def _record_path(folder: Path) -> Path | None:
    """Where the numbers of the config in `folder` are recorded, or None when they are not to be."""
    from importlib.metadata import PackageNotFoundError, version

    from deepspec.targets.embedded import cache_root

    try:
        raw = (folder / "config.json").read_bytes()
        model_type = json.loads(raw).get("model_type", "")
        transformers_version = version("transformers")
    except (OSError, ValueError, AttributeError, PackageNotFoundError):
        return None
    if not model_type or model_type.startswith("deepspec_"):  # our own test targets: their classes change with the code
        return None
    key = hashlib.sha256(raw + f"\0{transformers_version}\0{_VERSION}".encode()).hexdigest()[:24]
    return cache_root() / "target-configs" / f"{key}.json"


def _write(path: Path, values: dict[str, Any]) -> None:
    """Write the record whole or not at all (concurrent writers write the same bytes); a read-only cache is no error."""
    try:
        write_json_atomic(path, values)
    except (OSError, TypeError, ValueError) as e:
        log.debug("could not record the target config numbers in %s (%s)", path, e)
