"""Shared by the benchmarks that run a trained draft over a cache split it was not trained on
(bench_replay.py, bench_copy.py): input checks that print one JSON error line, and the loading."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def input_error(checkpoint: Path, cache_dir: Path) -> str | None:
    """A sentence naming the first missing input, or None when both are there."""
    for path, what in ((cache_dir / "manifest.json", "a cache (run `deepspec data cache` or the quickstart first)"),
                       (checkpoint / "config.json", "a draft checkpoint (step_N folder)")):
        if not path.is_file():
            return f"{path.parent} is not {what}"
    return None


def load_draft_and_cache(checkpoint: Path, cache_dir: Path, target_dtype: str | None = None) -> tuple[Any, Any, Any]:
    """(cache dataset, target, draft in eval mode) on the CPU; the target in the cache's dtype unless given."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from deepspec.data.cache.reader import CacheDataset
    from deepspec.drafts.checkpoint import load_draft
    from deepspec.targets import load_target

    data = CacheDataset(cache_dir)
    dtype = target_dtype or data.manifest.get("target_dtype", "float32")
    target = load_target(data.manifest["target"], dtype=dtype, device="cpu")
    return data, target, load_draft(checkpoint, target.model).eval()
