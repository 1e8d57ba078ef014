"""Keeping what a streamed run streamed (`cache.spool_keep: true`): the rank that reads a record moves it to
`<spool>/kept/` instead of deleting it; a producer asked for that sample again (the next epoch, a resumed trainer)
hard-links it back instead of running the target; when the trainer is done, the producers make the samples its plan
never read (the ragged tail of each epoch), and producer 0 writes every kept record as the offline train cache
(`<cache.dir>/train`: the shards, index, token counts and manifest a `deepspec data cache` build writes). The next
run of the recipe with `cache.mode: offline` trains from it. The kept folder grows to the whole cache: it is not
counted in `cache.spool_gb`.
"""

from __future__ import annotations

import os
import shutil
import zlib
from pathlib import Path

import numpy as np

from deepspec.data.cache import format as fmt
from deepspec.data.stream import spool as sp
from deepspec.diskfull import room_for
from deepspec.errors import CacheError
from deepspec.log import get_logger

log = get_logger(__name__)

def kept_path(spool: Path, index: int) -> Path:
    return spool / sp.KEPT / f"{index}{sp.SUFFIX}"


def restore(spool: Path, index: int) -> int:
    """Put a kept record back into the spool (a hard link: no bytes copied where the filesystem links); returns its
    size, 0 when it was never kept."""
    src = kept_path(spool, index)
    if not src.exists():
        return 0
    dst = sp.record_path(spool, index)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
    return src.stat().st_size


def write_cache(cfg, plan, spool: Path, target_config) -> Path:
    """Every kept record, in the plan's shards and order, as the offline train cache; returns its folder."""
    from deepspec.config import save_config
    from deepspec.data.cache.plan import check_resumable_plan, count_loss_tokens
    from deepspec.data.cache.shards import commit_shard, finalize, shard_done, target_identity

    directory = Path(cfg.cache_train_dir)
    if fmt.is_complete(directory):
        log.info("kept records: %s is already a complete cache", directory)
        return directory
    missing = [s.id for i, s in enumerate(plan.samples) if not kept_path(spool, i).exists()]
    if missing:
        raise CacheError(f"{len(missing)} planned samples (e.g. {missing[0]!r}) are not in {spool / sp.KEPT}; "
                         "rerun `deepspec data stream` with cache.spool_keep=true to make them.")
    directory.mkdir(parents=True, exist_ok=True)
    check_resumable_plan(directory, plan)
    for s, (a, b) in enumerate(plan.shards):
        if shard_done(directory, plan, s):
            continue
        rows = np.zeros(b - a, dtype=fmt.INDEX_DTYPE)
        counts = np.zeros(max(plan.vocab_size, 1), dtype=np.int64)
        tmp = directory / (fmt.shard_name(s) + ".tmp")
        offset = 0
        with room_for(directory / fmt.shard_name(s), plan.shard_bytes(s), "the kept cache's shard",
                      cleanup=lambda: tmp.unlink(missing_ok=True)), open(tmp, "wb") as f:
            for j in range(a, b):
                header, data = sp.read_record(kept_path(spool, j), verify=True)
                sample = plan.samples[j]
                if header["id"] != sample.id or header["length"] != sample.length:
                    raise CacheError(f"{kept_path(spool, j)} holds {header['id']!r}, the plan says {sample.id!r}; "
                                     "the kept folder belongs to another run — remove it.")
                ids, mask, _, _ = fmt.record_views(data, 0, sample.length, plan.n_layers, plan.hidden_size, plan.dtype)
                counts = count_loss_tokens(counts, ids.numpy(), mask.numpy())
                rows[j - a] = (s, offset, sample.length, len(data), zlib.crc32(data), int(mask.sum()), int(header["truncated"]))
                f.write(data)
                offset += len(data)
            f.flush()
            os.fsync(f.fileno())
        commit_shard(directory, s, tmp, counts, rows)
    save_config(cfg, directory)
    finalize(directory, plan, {**target_identity(target_config, plan), "made_by": "cache.mode=stream with cache.spool_keep"})
    log.info("the streamed run's kept records are now the offline train cache %s", directory)
    return directory
