"""`deepspec data cache CONFIG [--opts ...] [--estimate] [--verify] [--audit] [--overwrite] [--nproc N] [--split ...]`.

Builds the train cache and, when regenerated.heldout.jsonl exists, the held-out cache. Rerunning
resumes an interrupted build; a complete cache with the same settings is skipped. `--verify` checks
every sample's crc32 of finished caches, shards in parallel (training reads skip checksums: see
deepspec/data/cache/reader.py and verify.py); `--audit` checks that the cached hidden states are the target's own
(audit.py). Both take the recipe or a cache folder (one holding manifest.json) in place of CONFIG.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deepspec.config.args import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--estimate", action="store_true", help="print the bytes the cache will take and exit (writes nothing)")
    parser.add_argument("--verify", action="store_true", help="check every sample's checksum in the finished cache(s), shards in "
                        "parallel, and exit (1 if any shard is damaged); CONFIG may be a cache folder")
    parser.add_argument("--audit", action="store_true", help="check that the cached hidden states are the target's own (finite, "
                        "non-constant, matching a transformers forward tap by tap), save audit.json and exit (1 if not); CONFIG may be a cache folder")
    parser.add_argument("--overwrite", action="store_true", help="delete any existing cache for these splits and start over")
    parser.add_argument("--nproc", type=int, default=None, help="CPU worker processes (default cache.num_workers; under torchrun: one per rank)")
    parser.add_argument("--split", choices=["train", "heldout", "all"], default="all", help="which split(s) to build")


def splits_to_build(cfg, which: str = "all") -> list[str]:
    """train always; heldout when asked for or (with `all`) when its regenerated file exists."""
    if which != "all":
        return [which]
    return ["train"] + (["heldout"] if cfg.regenerated_heldout_path.is_file() else [])


def main(args: argparse.Namespace) -> int:
    from deepspec.data.cache.plan import estimate, plan_split, split_paths
    from deepspec.data.cache.writer import build_caches

    if (args.verify or args.audit) and (Path(args.config) / "manifest.json").is_file():
        directory = Path(args.config)
        return (verify_dirs([(directory.name, directory)]) if args.verify else 0) or (
            audit_dirs([(directory.name, directory)], None) if args.audit else 0)
    cfg = config_from_args(args)
    splits = splits_to_build(cfg, args.split)
    if args.verify or args.audit:
        dirs = [(split, split_paths(cfg, split)[1]) for split in splits]
        status = verify(cfg, splits) if args.verify else 0
        return status or (audit_dirs(dirs, cfg) if args.audit else 0)
    if args.estimate:
        for split in splits:
            print(json.dumps(estimate(plan_split(cfg, split))))
        return 0
    build_caches(cfg, splits, overwrite=args.overwrite, nproc=args.nproc)
    return 0


def verify(cfg, splits: list[str]) -> int:
    """Print one JSON line per split ({split, dir, samples, corrupt, ok, shards, damaged_shards, verdict}) and the verdict
    sentence on stderr; 1 when any shard is damaged."""
    from deepspec.data.cache.plan import split_paths

    return verify_dirs([(split, split_paths(cfg, split)[1]) for split in splits])


def verify_dirs(dirs: list[tuple[str, Path]]) -> int:
    from deepspec.data.cache import format as fmt
    from deepspec.data.cache.verify import verify_cache

    status = 0
    for split, directory in dirs:
        r = verify_cache(directory)
        bad = r.bad_samples
        print(json.dumps({"split": split, "dir": str(directory), "samples": r.samples, "corrupt": bad[:20], "num_corrupt": len(bad),
                          "ok": r.ok, "shards": r.shards, "damaged_shards": [fmt.shard_name(s) for s in sorted(r.damaged)],
                          "bytes": r.bytes, "seconds": round(r.seconds, 3), "verdict": r.verdict()}))
        print(r.verdict(), file=sys.stderr)
        status = status or (0 if r.ok else 1)
    return status


def audit_dirs(dirs: list[tuple[str, Path]], cfg) -> int:
    """Audit each cache (its report saved beside the manifest): one JSON line per split, the verdict on stderr; 1 on a failure."""
    from deepspec.data.cache.audit import audit_cache, load_reference_model
    from deepspec.data.cache.format import load_manifest

    from deepspec.config.data import CacheConfig

    cc = cfg.cache if cfg is not None else CacheConfig()
    status, model = 0, None
    for split, directory in dirs:
        if model is None and cc.audit_recompute > 0:
            model = load_reference_model(cfg, load_manifest(directory))
        report = audit_cache(directory, model=model, cfg=cfg, records=cc.audit_records, recompute=cc.audit_recompute)
        print(json.dumps({"split": split, "dir": str(directory), "ok": report["ok"], "failures": report["failures"],
                          "report": str(Path(directory) / "audit.json"), "seconds": report["seconds"]}))
        print(report["verdict"], file=sys.stderr)
        status = status or (0 if report["ok"] else 1)
    return status
