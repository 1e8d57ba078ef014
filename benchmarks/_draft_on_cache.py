"""Shared by the benchmarks that run a trained draft over a cache split it was not trained on
(bench_replay.py, bench_copy.py): input checks that print one JSON error line, and the loading."""

from __future__ import annotations

import contextlib
import os
import tempfile
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


@contextlib.contextmanager
def smoke_inputs(args):
    """--smoke: point args.checkpoint and args.cache at an untrained draft and the held-out cache of a tiny target
    (benchmarks/_smoke.py), removed afterwards; otherwise insist on a checkpoint."""
    if not args.smoke:
        if args.checkpoint is None:
            raise SystemExit("give a draft checkpoint (or --smoke)")
        yield
        return
    from _smoke import cached_split, smoke_env, tiny_recipe, untrained_checkpoint

    smoke_env()
    with tempfile.TemporaryDirectory(prefix="smoke_") as tmp:
        recipe = tiny_recipe(Path(tmp))
        args.cache = str(cached_split(recipe))
        args.checkpoint = str(untrained_checkpoint(recipe, Path(tmp) / "ckpt"))
        yield
