"""Building a cache: plan (plan.py), capture into shards (featurizer.py, shards.py), finalize, audit.

This module is the build's driver: the size and worker checks (guards.py), the workers (one process, spawned CPU
workers or torchrun ranks: ranks.py), then rank 0 writes the manifest and audits the capture (audit.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from deepspec.cpus import threads_per_worker
from deepspec.data.cache import format as fmt
from deepspec.data.cache.featurizer import CaptureSession
from deepspec.data.cache.guards import check_size, check_workers
from deepspec.data.cache.plan import Plan, check_resumable_plan, estimate, load_plan_inputs, make_plan, split_paths
from deepspec.data.cache.ranks import barrier, free_port, spawn_workers
from deepspec.data.cache.shards import finalize, target_identity, write_shards
from deepspec.errors import CacheError
from deepspec.log import get_logger

log = get_logger(__name__)


def build_caches(cfg, splits: list[str], *, overwrite: bool = False, nproc: int | None = None) -> list[Path]:
    """Build (or resume) several splits (train, heldout) with one capture engine; returns their directories."""
    session = CaptureSession()
    try:
        return [build_cache(cfg, split, overwrite=overwrite, nproc=nproc, session=session) for split in splits]
    finally:
        session.close()


def build_cache(cfg, split: str = "train", *, overwrite: bool = False, nproc: int | None = None,
                session: CaptureSession | None = None) -> Path:
    """Build (or resume) the cache of one split; returns its directory. Skips a complete matching cache.

    Workers: under torchrun (WORLD_SIZE > 1) each rank takes its shards and rank 0 finalizes;
    otherwise `nproc` (default cache.num_workers) CPU processes are spawned. `session`: see `build_caches`.
    One build per folder: rank 0 (or the single process) holds the split folder's lock (deepspec/locks.py)."""
    from deepspec.locks import folder_lock

    _, directory = split_paths(cfg, split)
    with folder_lock(directory, "cache build", enabled=int(os.environ.get("RANK", "0")) == 0):
        return _build_cache(cfg, split, overwrite=overwrite, nproc=nproc, session=session)


def _build_cache(cfg, split: str, *, overwrite: bool, nproc: int | None, session: CaptureSession | None) -> Path:
    from deepspec.config import save_config

    _, directory = split_paths(cfg, split)
    directory = Path(directory)
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    rank_env = int(os.environ.get("RANK", "0"))
    check_workers(cfg, world_env if world_env > 1 else (nproc or cfg.cache.num_workers or 1))
    if overwrite and directory.exists() and rank_env == 0:
        shutil.rmtree(directory)
    if world_env > 1:
        barrier()
    tokenizer, tconf = load_plan_inputs(cfg)
    plan = make_plan(cfg, split, tokenizer, tconf)
    if fmt.is_complete(directory):
        manifest = fmt.load_manifest(directory)
        diffs = [k for k, v in plan.signature.items() if manifest.get(k) != v]
        if not diffs:
            log.info("cache %s is complete; skipping (use --overwrite to rebuild)", directory)
            return directory
        raise CacheError(
            f"{directory} holds a complete cache built with different settings ({', '.join(diffs)} differ); "
            "rerun with --overwrite to rebuild it."
        )
    est = estimate(plan)
    log.info(
        "cache %s: %d samples, %d tokens (%d dropped < %d loss tokens, %d truncated) -> %.3f GiB in %d shard(s)",
        split, est["samples"], est["tokens"], est["dropped_short"], cfg.cache.min_loss_tokens, est["truncated"], est["gib"], est["shards"],
    )
    _size_check(directory, plan, cfg, world_env, rank_env)  # before any file is written or any target is loaded
    directory.mkdir(parents=True, exist_ok=True)
    if rank_env == 0:
        check_resumable_plan(directory, plan)
    if world_env > 1:
        barrier()
        check_resumable_plan(directory, plan)
        write_shards(directory, plan, rank_env, world_env, cfg=cfg)
        barrier()
    else:
        nproc = nproc or cfg.cache.num_workers or 1
        if nproc <= 1:
            write_shards(directory, plan, 0, 1, cfg=cfg, session=session)
        else:
            import torch.multiprocessing as mp

            threads = threads_per_worker(nproc)
            try:
                spawn_workers(mp, nproc, (nproc, free_port(), cfg, split, threads, build_cache))
            except mp.ProcessRaisedException as e:
                last = str(e).strip().splitlines()[-1]
                raise CacheError(f"A cache worker failed ({last}); fix the cause and rerun the same command to resume.") from None
            except mp.ProcessExitedException as e:
                raise CacheError(f"A cache worker died ({e}); rerun the same command to resume.") from None
            return directory  # rank 0 of the workers finalized it
    if rank_env == 0:
        save_config(cfg, directory)
        finalize(directory, plan, target_identity(tconf, plan))  # the manifest goes last
        log.info("cache %s complete: %s", split, directory)
        from deepspec.data.cache.audit import audit_after_build

        audit_after_build(cfg, directory, session)  # audit.json beside the manifest; a failed capture stops here
    if world_env > 1:
        barrier()
    return directory


def _size_check(directory: Path, plan: Plan, cfg, world: int, rank: int) -> None:
    """guards.check_size, decided once: under torchrun rank 0 checks and every rank raises the same error (a rank
    that passed while another stopped would wait at the next barrier for hours)."""
    if world <= 1:
        check_size(directory, plan, cfg)
        return
    import torch.distributed as dist

    message = [None]
    if rank == 0:
        try:
            check_size(directory, plan, cfg)
        except CacheError as e:
            message = [str(e)]
    barrier()  # joins the group
    dist.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise CacheError(message[0])
