"""`deepspec data cache CONFIG [--opts ...] [--estimate] [--verify] [--overwrite] [--nproc N] [--split ...]`.

Builds the train cache and, when regenerated.heldout.jsonl exists, the held-out cache. Rerunning
resumes an interrupted build; a complete cache with the same settings is skipped. `--verify` checks
every sample's crc32 of finished caches (training reads skip checksums: see deepspec/data/cache/reader.py).
"""

from __future__ import annotations

import argparse
import json

from deepspec.cli import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--estimate", action="store_true", help="print the bytes the cache will take and exit (writes nothing)")
    parser.add_argument("--verify", action="store_true", help="check every sample's checksum in the finished cache(s) and exit (1 if any is corrupt)")
    parser.add_argument("--overwrite", action="store_true", help="delete any existing cache for these splits and start over")
    parser.add_argument("--nproc", type=int, default=None, help="CPU worker processes (default cache.num_workers; under torchrun: one per rank)")
    parser.add_argument("--split", choices=["train", "heldout", "all"], default="all", help="which split(s) to build")


def splits_to_build(cfg, which: str = "all") -> list[str]:
    """train always; heldout when asked for or (with `all`) when its regenerated file exists."""
    if which != "all":
        return [which]
    return ["train"] + (["heldout"] if cfg.regenerated_heldout_path.is_file() else [])


def main(args: argparse.Namespace) -> int:
    from deepspec.data.cache.writer import build_caches, estimate, plan_split

    cfg = config_from_args(args)
    splits = splits_to_build(cfg, args.split)
    if args.verify:
        return verify(cfg, splits)
    if args.estimate:
        for split in splits:
            print(json.dumps(estimate(plan_split(cfg, split))))
        return 0
    build_caches(cfg, splits, overwrite=args.overwrite, nproc=args.nproc)
    return 0


def verify(cfg, splits: list[str]) -> int:
    """Print one JSON line per split ({split, dir, samples, corrupt, ok}); 1 when any sample is corrupt."""
    from deepspec.data.cache.reader import CacheDataset
    from deepspec.data.cache.writer import split_paths

    status = 0
    for split in splits:
        directory = split_paths(cfg, split)[1]
        ds = CacheDataset(directory)
        bad = ds.verify_all()
        ds.close()
        print(json.dumps({"split": split, "dir": str(directory), "samples": len(ds), "corrupt": bad[:20],
                          "num_corrupt": len(bad), "ok": not bad}))
        status = status or (1 if bad else 0)
    return status
