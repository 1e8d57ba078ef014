"""Re-checking a finished cache's checksums: all of it (`deepspec data cache --verify`), or a sample at training start.

Why: training reads skip checksums (at the users' scale one per read costs as much as the copy, see reader.py), so a
shard that rots on disk after the build would otherwise be trained on silently. A full check reads every byte once,
shards in parallel (zlib's crc32 and file reads release the GIL, so threads sized to the cores keep the disks busy);
the check at training start reads a bounded sample (`cache.start_check_mb` from up to `cache.start_check_shards`
shards) so a long run never starts on a shard that is already damaged, at the cost of a second or so.
"""

from __future__ import annotations

import random
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from deepspec.data.cache import format as fmt
from deepspec.errors import CacheError
from deepspec.log import get_logger, progress

log = get_logger(__name__)

GIB = 2**30
# The file is read in pieces of at most this many bytes per crc32 call, so the progress bar moves within a big record.
CHUNK = 64 * 2**20


@dataclass
class VerifyResult:
    """What a checksum pass found: the damaged shards (by number) with the ids of their bad samples."""

    directory: Path
    shards: int
    bytes: int
    seconds: float
    samples: int
    damaged: dict[int, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.damaged

    @property
    def bad_samples(self) -> list[str]:
        return [sid for ids in self.damaged.values() for sid in ids]

    def verdict(self) -> str:
        """One sentence: what was checked, or which shards are damaged and how to rebuild them (the cache's recipe,
        CONFIG, is copied beside it as config.yaml)."""
        if self.ok:
            return (f"ok: {self.shards} shard(s), {self.samples} samples, {self.bytes / GIB:.3f} GiB of {self.directory} "
                    f"verified in {self.seconds:.1f} s.")
        names = ", ".join(f"{fmt.shard_name(s)} ({len(ids)} sample(s), e.g. {ids[0]!r})" for s, ids in sorted(self.damaged.items()))
        return (f"{len(self.damaged)} of {self.shards} shard(s) of {self.directory} fail their checksums: {names}; "
                "delete those shard files and rerun `deepspec data cache CONFIG` with the recipe that built the cache (a copy is "
                f"its config.yaml), which rewrites only the missing shards.")


def _crc(view: memoryview, bar) -> int:
    crc = 0
    for a in range(0, len(view), CHUNK):
        piece = view[a : a + CHUNK]
        crc = zlib.crc32(piece, crc)
        bar.update(len(piece))
    return crc


def check_rows(directory: Path, shard: int, rows: np.ndarray, positions: Sequence[int], bar) -> list[int]:
    """crc32 of the given index rows of one shard (a record past the file's end counts as damaged); returns the bad
    positions. Reads through a private map, so nothing is copied and the page cache does the I/O."""
    import mmap

    path = directory / fmt.shard_name(shard)
    try:
        size = path.stat().st_size
        f = open(path, "rb")
    except OSError:
        return list(positions)
    bad = []
    with f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        try:
            with memoryview(m if m is not None else b"") as view:
                for p in positions:
                    off, nbytes = int(rows[p]["offset"]), int(rows[p]["nbytes"])
                    if off + nbytes > size or _crc(view[off : off + nbytes], bar) != int(rows[p]["crc32"]):
                        bad.append(p)
        finally:
            if m is not None:
                m.close()
    return bad


def _ids(directory: Path) -> list[str]:
    import json

    return json.loads((directory / fmt.IDS).read_text())


def _load(directory: Path) -> tuple[dict, np.ndarray]:
    manifest = fmt.load_manifest(directory)
    index = np.load(directory / fmt.INDEX)
    if len(index) != manifest["counts"]["samples"]:
        raise CacheError(f"{directory}/{fmt.INDEX} has {len(index)} rows but the manifest says {manifest['counts']['samples']}; "
                         "rebuild the cache with --overwrite.")
    return manifest, index


def _check(directory: Path, index: np.ndarray, plan: dict[int, list[int]], workers: int | None, desc: str | None) -> VerifyResult:
    """Check the index rows `plan` names per shard, shards in parallel; `desc` None hides the progress bar."""
    from deepspec.cpus import usable_cpus

    t0 = time.perf_counter()
    total = int(sum(int(index[p]["nbytes"]) for ps in plan.values() for p in ps))
    workers = max(1, min(workers or len(usable_cpus()), len(plan) or 1))
    quiet = {} if desc else {"disable": True}
    damaged: dict[int, list[int]] = {}
    with progress(total=total, desc=desc or "verify", unit="B", unit_scale=True, **quiet) as bar:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify") as pool:
            futures = {s: pool.submit(check_rows, directory, s, index, ps, bar) for s, ps in sorted(plan.items())}
            for s, fut in futures.items():
                bad = fut.result()
                if bad:
                    damaged[s] = bad
    ids = _ids(directory) if damaged else []
    return VerifyResult(Path(directory), len(plan), total, time.perf_counter() - t0, sum(len(ps) for ps in plan.values()),
                        {s: [ids[p] for p in bad] for s, bad in damaged.items()})


def verify_cache(directory: str | Path, *, workers: int | None = None, progress_bar: bool = True) -> VerifyResult:
    """Every sample's crc32 of a finished cache, one shard per task on `workers` threads (default: the usable cores)."""
    directory = Path(directory)
    manifest, index = _load(directory)
    plan: dict[int, list[int]] = {s: [] for s in range(int(manifest["num_shards"]))}
    for p, s in enumerate(index["shard"]):
        plan[int(s)].append(p)
    return _check(directory, index, plan, workers, f"verify {directory.name}" if progress_bar else None)


def sample_plan(index: np.ndarray, num_shards: int, max_bytes: float | None, max_shards: int, rng: random.Random) -> dict[int, list[int]]:
    """Rows to check at training start: up to `max_shards` shards drawn at random, each given an equal share of
    `max_bytes` (None: everything) filled with its records in random order; every drawn shard gets at least one."""
    shards = list(range(num_shards))
    if max_bytes is not None:
        shards = sorted(rng.sample(shards, min(max_shards, num_shards)))
    plan: dict[int, list[int]] = {}
    share = None if max_bytes is None else max_bytes / max(1, len(shards))
    for s in shards:
        rows = [int(p) for p in np.nonzero(index["shard"] == s)[0]]
        rng.shuffle(rows)
        chosen, used = [], 0
        for p in rows:
            n = int(index[p]["nbytes"])
            if chosen and share is not None and used + n > share:
                continue
            chosen.append(p)
            used += n
        if chosen:
            plan[s] = sorted(chosen)
    return plan


def check_at_start(directory: str | Path, max_mb: float | None, max_shards: int, *, seed: int | None = None) -> VerifyResult | None:
    """The training-start spot check: raises CacheError (one sentence naming the damaged shard) when a sampled record
    fails its checksum. `max_mb` 0 turns it off (returns None); None checks the whole cache."""
    if max_mb is not None and (max_mb <= 0 or max_shards <= 0):
        return None
    directory = Path(directory)
    manifest, index = _load(directory)
    plan = sample_plan(index, int(manifest["num_shards"]), None if max_mb is None else max_mb * 2**20, max_shards, random.Random(seed))
    result = _check(directory, index, plan, None, None)
    if not result.ok:
        s, ids = min(result.damaged.items())
        raise CacheError(
            f"{directory}/{fmt.shard_name(s)} is damaged (sample {ids[0]!r} fails its checksum), so training stopped before "
            f"reading it; run `deepspec data cache CONFIG --verify` to list every damaged shard, delete them and rerun "
            "`deepspec data cache CONFIG` to rewrite them."
        )
    log.info("cache %s: checksums of %d sample(s) in %d of %d shard(s) ok (%.1f MiB in %.2f s; cache.start_check_mb)",
             directory, result.samples, result.shards, int(manifest["num_shards"]), result.bytes / 2**20, result.seconds)
    return result
