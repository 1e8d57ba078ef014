"""Cache reader throughput: an on-disk cache of a real target's shape read through the trainer's whole loader path.

    .venv/bin/python benchmarks/bench_loader.py --shape qwen3-8b --seq-len 4096 [--samples 16] [--workers 0 1 2]
        [--baseline-rev 0d15c21] [--dir DIR] [--passes 3] [--micro-batch 4 --pack-tokens 8192]

Builds a cache of `--samples` samples of `--seq-len` tokens with the shape's taps (+ the final state), width and
dtype, reads it from the (warm) page cache through the loader the trainer uses — plan order, collation into batch
tensors, pinned memory and the copy to the GPU where there is one — and prints one JSON object:

  tokens_per_s / gb_per_s          this tree's loader (the best of `--workers`; `workers` says which)
  baseline_tokens_per_s            the loader of `--baseline-rev` (checked out with `git worktree`) on the same
                                   cache in the same run, with that revision's defaults
  memcpy_gb_per_s                  the machine's ceiling measured in the same run: a large pre-touched buffer
                                   copied by torch
  by_workers                       tokens/s for each loader process count tried (0 = one background thread)

GB are feature bytes (taps + final state in the cache dtype) per second, 1 GB = 1e9 bytes.

`--pack-tokens N` measures the packed path (train.pack_tokens = N): each micro-batch's samples packed into rows of
about N tokens, as the trainer's collate does (give `--micro-batch` > 1 so rows hold several samples). Against a
`--baseline-rev` from before one-copy packing this compares collate + zero-filled repack + pin with packing straight
from the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (hidden size, taps, tap rows per tap (multi-stream concat), dtype): the recipes' cache shapes.
SHAPES = {
    "qwen3-8b": (4096, 5, 1, "bf16"),
    "qwen3-4b": (2560, 5, 1, "bf16"),
    "qwen3-8b-fp8": (4096, 5, 1, "fp8"),
    "deepseek-v4-flash-dflash": (4096, 5, 4, "bf16"),
    "smollm2-135m": (576, 3, 1, "bf16"),
}


def build_cache(directory: Path, shape: str, seq_len: int, samples: int, per_shard: int = 4) -> dict:
    """Write a complete cache of random features (the same record bytes for every sample: read speed does not
    depend on the values) with a manifest any reader of format version 1 accepts."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from deepspec.data.cache import format as fmt

    hidden, taps, rows, dtype = SHAPES[shape]
    n_layers = taps * rows + 1
    layout = fmt.record_layout(seq_len, n_layers, hidden, dtype)
    rec = bytearray(layout["total"][1])
    rng = np.random.default_rng(0)
    off, size = layout["input_ids"]
    rec[off : off + size] = rng.integers(0, 32000, seq_len, dtype="<i4").tobytes()
    off, size = layout["loss_mask"]
    rec[off : off + size] = np.ones(seq_len, np.uint8).tobytes()
    off, size = layout["features"]
    if dtype == "bf16":  # random normals' upper 16 bits = bf16 values of the same distribution
        rec[off : off + size] = (rng.standard_normal(size // 2, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    else:
        rec[off : off + size] = rng.integers(0, 0x7E, size, dtype=np.uint8).tobytes()
        soff, ssize = layout["scales"]
        rec[soff : soff + ssize] = np.full(ssize // 4, 0.01, "<f4").tobytes()
    rec = bytes(rec)
    crc = zlib.crc32(rec)
    index = np.zeros(samples, dtype=fmt.INDEX_DTYPE)
    directory.mkdir(parents=True, exist_ok=True)
    n_shards = -(-samples // per_shard)
    for s in range(n_shards):
        with open(directory / fmt.shard_name(s), "wb") as f:
            for j, i in enumerate(range(s * per_shard, min(samples, (s + 1) * per_shard))):
                f.write(rec)
                index[i] = (s, j * len(rec), seq_len, len(rec), crc, seq_len, 0)
    np.save(directory / fmt.INDEX, index)
    (directory / fmt.IDS).write_text(json.dumps([f"bench-{i}" for i in range(samples)]))
    np.save(directory / fmt.TOKEN_COUNTS, np.ones(32000, np.int64))
    manifest = {"format_version": fmt.FORMAT_VERSION, "counts": {"samples": samples, "tokens": samples * seq_len},
                "num_shards": n_shards, "taps": list(range(taps)), "hidden_size": hidden, "dtype": dtype,
                "hc_mult": rows if rows > 1 else 1, "tap_reduction": "concat" if rows > 1 else "mean",
                "target": f"bench-{shape}"}
    fmt.write_json_atomic(directory / fmt.MANIFEST, manifest)
    return {"record_bytes": len(rec), "feature_bytes_per_token": layout["features"][1] // seq_len}


def warm(directory: Path) -> None:
    """Read every shard once so both loaders read from the page cache (this measures the loader, not the disk)."""
    for p in sorted(directory.glob("shard_*.bin")):
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def memcpy_gb_per_s(nbytes: int = 1 << 30, reps: int = 5) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # both pre-touched
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def measure(cache: str, workers: int, passes: int, micro_batch: int, pack_tokens: int = 0) -> dict:
    """Tokens/s through this interpreter's deepspec loader (whichever revision sys.path gives). Each pass opens
    the cache anew, so its shards are mapped afresh as in an epoch of a real run (no pages left mapped from the
    previous pass); each pass's first batch (worker start-up) is not timed."""
    import torch

    import deepspec.data.batches as batches
    from deepspec.data.cache.reader import CacheDataset

    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else None
    tokens, elapsed, first = 0, 0.0, []
    for p in range(passes):
        ds = CacheDataset(cache)
        n = len(ds)
        bpt = int(ds.index["nbytes"][0]) // int(ds.index["length"][0])
        schedule = [(p, m, list(range(m * micro_batch, (m + 1) * micro_batch))) for m in range(n // micro_batch)]
        collate = batches.collate_fn(ds)
        if pack_tokens:  # the trainer's packed collate (train.pack_tokens), as its loop wraps it
            collate = batches.packing(collate, pack_tokens)
        try:
            from deepspec.train.loader import build_loader
        except ImportError:  # a revision before worker processes: its thread prefetcher, as its loop built it
            if cuda:
                from deepspec.train.staging import pin_batch

                collate = pin_batch(collate)
            loader = batches.Prefetcher(ds, collate, iter(schedule), 2)
        else:
            import inspect

            packed = {"packed": True} if pack_tokens and "packed" in inspect.signature(build_loader).parameters else {}
            loader = build_loader(ds, collate, iter(schedule), depth=2, processes=workers, pin=cuda, **packed)
        t0 = time.perf_counter()
        seen = None
        for _step, _m, batch in loader:
            if device is not None:
                batch = batch.to(device)
            if seen is None:  # start the clock when the first batch is in
                first.append(time.perf_counter() - t0)
                seen, t0 = 0, time.perf_counter()
                continue
            seen += int(batch.attention_mask.sum())
        if device is not None:
            torch.cuda.synchronize()
        elapsed += time.perf_counter() - t0
        tokens += seen or 0
        loader.close()
        del ds, loader, batch
    return {"tokens_per_s": tokens / elapsed, "gb_per_s": tokens * bpt / elapsed / 1e9, "first_batch_s": max(first),
            "tokens": tokens, "seconds": elapsed, "to_device": device is not None, "deepspec": __import__("deepspec").__file__}


def baseline_checkout(rev: str) -> Path:
    path = Path(tempfile.gettempdir()) / f"deepspec-baseline-{rev}"
    if not (path / "deepspec").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


def run_measure(src: Path, cache: Path, workers: int, passes: int, micro_batch: int, pack_tokens: int = 0) -> dict:
    """One measurement in a fresh interpreter importing deepspec from `src` (so revisions never mix)."""
    cmd = [sys.executable, __file__, "--_measure", str(cache), "--_src", str(src), "--_workers", str(workers),
           "--passes", str(passes), "--micro-batch", str(micro_batch), "--pack-tokens", str(pack_tokens)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(src)))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--passes", type=int, default=3, help="epochs over the cache per measurement")
    ap.add_argument("--pack-tokens", type=int, default=0, help="measure the packed path: rows of about N tokens (0 = unpacked)")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="loader processes to try (0 = thread)")
    ap.add_argument("--baseline-rev", default="0d15c21")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--dir", default=None, help="where to build the cache (default: a temporary folder, removed)")
    ap.add_argument("--smoke", action="store_true", help="8 SmolLM2-shaped samples of 64 tokens, loader thread and one "
                    "process, no baseline, a 16 MB memcpy: a check of the code path")
    ap.add_argument("--_measure", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_src", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_workers", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._measure:
        sys.path.insert(0, args._src)
        print(json.dumps(measure(args._measure, args._workers, args.passes, args.micro_batch, args.pack_tokens)))
        return 0

    import shutil

    import torch

    if args.smoke:
        args.shape, args.seq_len, args.samples, args.passes, args.workers = "smollm2-135m", 64, 8, 2, [0, 1]
        args.no_baseline = True

    tmp = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_loader_"))
    cache = tmp / f"cache-{args.shape}-{args.seq_len}"
    try:
        t = time.perf_counter()
        info = build_cache(cache, args.shape, args.seq_len, args.samples)
        build_s = time.perf_counter() - t
        warm(cache)
        ceiling = memcpy_gb_per_s(1 << 24) if args.smoke else memcpy_gb_per_s()
        by_workers = {w: run_measure(ROOT, cache, w, args.passes, args.micro_batch, args.pack_tokens) for w in args.workers}
        best_w = max(by_workers, key=lambda w: by_workers[w]["tokens_per_s"])
        out = {
            **({"smoke": True, "not_run": "the baseline revision's loader (a git worktree of --baseline-rev)"} if args.smoke else {}),
            "shape": args.shape, "seq_len": args.seq_len, "samples": args.samples, "micro_batch": args.micro_batch,
            "pack_tokens": args.pack_tokens,
            "dtype": SHAPES[args.shape][3], "feature_bytes_per_token": info["feature_bytes_per_token"],
            "cache_gb": round(info["record_bytes"] * args.samples / 1e9, 2), "build_s": round(build_s, 1),
            "device": "cuda" if torch.cuda.is_available() else "cpu", "cpus": len(os.sched_getaffinity(0)),
            "workers": best_w, "tokens_per_s": round(by_workers[best_w]["tokens_per_s"]),
            "gb_per_s": round(by_workers[best_w]["gb_per_s"], 3), "memcpy_gb_per_s": round(ceiling, 2),
            "by_workers": {str(w): round(r["tokens_per_s"]) for w, r in by_workers.items()},
        }
        out["share_of_memcpy"] = round(out["gb_per_s"] / ceiling, 3)
        if not args.no_baseline:
            base = run_measure(baseline_checkout(args.baseline_rev), cache, 0, max(1, args.passes - 1), args.micro_batch,
                               args.pack_tokens)
            out.update({"baseline_rev": args.baseline_rev, "baseline_tokens_per_s": round(base["tokens_per_s"]),
                        "baseline_gb_per_s": round(base["gb_per_s"], 3),
                        "speedup": round(out["tokens_per_s"] / base["tokens_per_s"], 2)})
        print(json.dumps(out))
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
