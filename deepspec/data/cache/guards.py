"""Checks a cache build makes before it loads a target: will it fit, and is it started the way the target needs.

Why before: loading a large target takes minutes and a build that cannot finish (a 98 TB cache on a 10 TB disk, or
eight workers each loading a target that `target.device_map` spreads over the node's eight GPUs) should fail in the
first seconds with a sentence, not hours later with a full disk or an out-of-memory error.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from deepspec.errors import CacheError, ConfigError
from deepspec.log import get_logger

log = get_logger(__name__)

GB = 10**9


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem that holds `path` (or its nearest existing parent: the folder may not exist yet)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def _gb(n: float) -> str:
    return f"{n / GB:,.1f} GB" if n >= GB else f"{n / GB:,.3g} GB"


def remaining_bytes(directory: Path, plan) -> int:
    """Bytes still to write: a resumed build counts only the shards that are not complete yet."""
    from deepspec.data.cache.shards import shard_done

    return sum(plan.shard_bytes(s) for s in range(len(plan.shards)) if not shard_done(directory, plan, s))


def check_size(directory: Path, plan, cfg) -> int:
    """Log the build's estimate; raise CacheError when what is left to write exceeds the free disk of the cache folder
    or `cache.max_gb`. Returns the bytes still to write."""
    from deepspec.data.cache.plan import estimate

    est = estimate(plan)
    todo = remaining_bytes(directory, plan)
    split = plan.signature["split"]
    free = free_bytes(directory)
    limit = cfg.cache.max_gb
    log.info("cache %s: %s still to write (of %s), %s free at %s%s", split, _gb(todo), _gb(est["bytes"]), _gb(free), directory,
             f", cache.max_gb={limit:g}" if limit is not None else "")
    if todo == 0:
        return 0
    over = []
    if todo > free:
        over.append(f"only {_gb(free)} are free at {directory}")
    if limit is not None and todo > limit * GB:
        over.append(f"cache.max_gb is {limit:g}")
    if not over:
        return todo
    fp8 = "" if plan.dtype == "fp8" else "store it in fp8 (cache.dtype=fp8, about half the bytes), "
    raise CacheError(
        f"The {split} cache needs {_gb(todo)}{' more' if todo != est['bytes'] else ''} ({est['samples']:,} samples, {est['tokens']:,} tokens, "
        f"{est['bytes_per_token']:,.0f} bytes/token in {plan.dtype}) but {' and '.join(over)}, so it stopped before loading the target; "
        f"{fp8}cache fewer or shorter samples (data.prompts.max_samples, cache.max_length), point cache.dir at a larger disk, "
        "or store no cache at all: stream it (cache.mode=stream: producers feed the trainer through a spool capped by cache.spool_gb) "
        "or train co-located (cache.mode=online: the trainer runs the target)."
    )


def check_workers(cfg, workers: int) -> None:
    """`target.device_map` spreads ONE target over all of a node's GPUs; N cache workers would each load all of it."""
    dm = getattr(cfg.target, "device_map", None)
    if dm is None or workers <= 1:
        return
    raise ConfigError(
        f"target.device_map={dm} spreads one copy of the target over all of this node's GPUs, but this cache build "
        f"starts {workers} workers that would each load the whole target; run one process instead "
        "(`bash scripts/data/cache.sh CONFIG --nproc 1`, or `deepspec data cache CONFIG --nproc 1` with cache.num_workers=1), "
        "or set target.device_map=null to give each worker its own GPU when the target fits on one."
    )
