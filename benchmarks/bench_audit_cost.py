#!/usr/bin/env python
"""What the capture audit adds to a recipe's cache stage: prints one JSON object.

    python benchmarks/bench_audit_cost.py --data DIR [--recipe config/quickstart/eagle3_blend.yaml] [--max-samples N]
    python benchmarks/bench_audit_cost.py --smoke      # the tiny random Llama of the tests: a check of the path

DIR holds the regenerated answers the cache stage reads (regenerated.jsonl, optionally regenerated.heldout.jsonl, as
`deepspec data regenerate` writes them); the first N of each are copied into a scratch data folder, so the cache is
built from exactly those records. The recipe's cache stage is then run as `deepspec data cache` runs it (its capture
backend, taps, dtype and workers) with `cache.audit=false`, timed; then the audit as `deepspec data cache --audit`
runs it: the target loaded once for the recomputation, then each split audited (`cache.audit_records` records read,
`cache.audit_recompute` of them recomputed), each timed. The audit's cost does not grow with the cache (a fixed number
of records), so the share it adds falls as the cache grows; the JSON gives the per-sample build time to scale from.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _emit import emit_json  # noqa: E402


def _copy_head(src: Path, dst: Path, n: int | None) -> int:
    """The first n records of a JSONL file (all when n is None); returns how many were copied."""
    lines = [ln for ln in src.read_text().splitlines() if ln.strip()][:n]
    dst.write_text("".join(ln + "\n" for ln in lines))
    return len(lines)


def _smoke(tmp: Path) -> tuple[str, Path]:
    """The tests' tiny random Llama target and 8 + 2 short conversations (tests/tiny_recipe.py) over the quickstart's
    EAGLE-3 recipe: (recipe path, data folder)."""
    import random

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_recipe import conversation

    from deepspec.targets import save_tiny_target

    target = save_tiny_target(tmp / "target", "llama")
    src = tmp / "src"
    src.mkdir()
    rng = random.Random(0)
    (src / "regenerated.jsonl").write_text("".join(json.dumps(conversation(rng, i)) + "\n" for i in range(8)))
    (src / "regenerated.heldout.jsonl").write_text("".join(json.dumps(conversation(rng, 100 + i)) + "\n" for i in range(2)))
    recipe = tmp / "recipe.yaml"
    recipe.write_text(f"_base_: {ROOT}/config/quickstart/eagle3.yaml\nproject: audit\ntarget: {{name: {target}}}\n"
                      "cache: {max_length: 96}\nmodel: {target_layer_ids: [0, 2, 4], draft_vocab_size: null, init_copy_heads: false}\n")
    return str(recipe), src


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "config/quickstart/eagle3_blend.yaml"))
    ap.add_argument("--data", help="folder with regenerated.jsonl (+ regenerated.heldout.jsonl) for the recipe's cache stage")
    ap.add_argument("--max-samples", type=int, default=None, help="the first N records of each split (default: all)")
    ap.add_argument("--opts", nargs="*", default=[], help="recipe overrides (key=value)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    os.environ.setdefault("DEEPSPEC_NO_PROGRESS", "1")
    if bool(args.data) == bool(args.smoke):
        print(json.dumps({"error": "give exactly one of --data DIR or --smoke"}))
        return 2

    from deepspec.config import load_config
    from deepspec.data.cache.audit import audit_cache, load_reference_model
    from deepspec.data.cache.cli import splits_to_build
    from deepspec.data.cache.format import load_manifest
    from deepspec.data.cache.plan import split_paths
    from deepspec.data.cache.writer import build_caches

    with tempfile.TemporaryDirectory(prefix="bench-audit-") as tmp_s:
        tmp = Path(tmp_s)
        recipe, src = _smoke(tmp) if args.smoke else (args.recipe, Path(args.data))
        opts: list[str] = []
        data = tmp / "data"
        data.mkdir()
        counts = {}
        for name, split in (("regenerated.jsonl", "train"), ("regenerated.heldout.jsonl", "heldout")):
            if (src / name).is_file():
                counts[split] = _copy_head(src / name, data / name, args.max_samples)
        if not counts.get("train"):
            print(json.dumps({"error": f"{src} holds no regenerated.jsonl; run `deepspec data regenerate` on the recipe first"}))
            return 2
        opts += [f"data.dir={data}", f"cache.dir={tmp / 'cache'}", f"output_root={tmp / 'outputs'}", "cache.audit=false",
                 "logging.wandb=false", *args.opts]
        cfg = load_config(recipe, opts)
        splits = splits_to_build(cfg)
        t0 = time.perf_counter()
        build_caches(cfg, splits)
        build_s = time.perf_counter() - t0
        dirs = [(s, split_paths(cfg, s)[1]) for s in splits]
        cc = cfg.cache
        t0 = time.perf_counter()
        model = load_reference_model(cfg, load_manifest(dirs[0][1])) if cc.audit_recompute > 0 else None
        load_s = time.perf_counter() - t0
        per_split = {}
        for split, d in dirs:
            t0 = time.perf_counter()
            rep = audit_cache(d, model=model, cfg=cfg, records=cc.audit_records, recompute=cc.audit_recompute)
            man = load_manifest(d)
            per_split[split] = {"audit_s": round(time.perf_counter() - t0, 3), "ok": rep["ok"], "failures": rep["failures"],
                                "samples": man["counts"]["samples"], "counts": man["counts"]}
        audit_s = load_s + sum(v["audit_s"] for v in per_split.values())
        samples = sum(v["samples"] or 0 for v in per_split.values())
        res = {
            "smoke": bool(args.smoke), "recipe": str(recipe), "data": str(src), "max_samples": args.max_samples,
            "records_per_split": counts, "capture_backend": cc.capture_backend, "target": cfg.target.name,
            "dtype": cc.dtype, "target_dtype": cfg.target.dtype, "audit_records": cc.audit_records,
            "audit_recompute": cc.audit_recompute, "cpu_threads": os.cpu_count(),
            "build_s": round(build_s, 3), "build_s_per_sample": round(build_s / max(samples, 1), 4),
            "audit_load_target_s": round(load_s, 3), "audit_per_split": per_split, "audit_s": round(audit_s, 3),
            "audit_share_of_build": round(audit_s / build_s, 4),
        }
        shutil.rmtree(tmp / "cache", ignore_errors=True)
    emit_json(res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
