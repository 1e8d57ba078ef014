"""The target hidden-state cache: plan, featurizer and shards driven by the writer; reader, sampler, online mode.
Streamed training's spool and producers, built on this format, live in deepspec/data/stream/.

Import the pieces from their modules (they import torch lazily); this package only names them.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "build_cache": "writer", "build_caches": "writer", "plan_split": "plan", "estimate": "plan", "resolve_taps": "plan",
    "is_complete": "format", "load_manifest": "format", "check_manifest": "format",
    "CacheDataset": "reader", "collate": "reader", "open_cache": "reader", "expected_provenance": "reader",
    "ResumableBatchSampler": "sampler",
    "OnlineDataset": "online", "OnlineFeatures": "online",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"deepspec.data.cache.{_EXPORTS[name]}"), name)
    raise AttributeError(name)
