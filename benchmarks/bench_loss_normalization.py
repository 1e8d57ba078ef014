#!/usr/bin/env python
"""Token-weighted vs per-B·T loss normalisation (train.loss_normalization), side by side on one recipe's data,
each draft served by vLLM on a held-out split. Prints one JSON object.

    flock /tmp/deepspec-heavy.lock python benchmarks/bench_loss_normalization.py config/quickstart/eagle3_blend.yaml \
        [--opts k=v ...] [--shape k=v ...] [--modes tokens positions] [--seeds 0 1] [--split heldout:general]

The data stages (prompts, answers, cache) run once; then for every seed and mode a run named
`lossnorm-<mode>-s<seed>[-<tag>]` trains with the recipe plus `--shape` and is evaluated by us and served by vLLM
(T = 0, the recipe's speculative tokens) on the split. Finished runs are reused, so an interrupted benchmark
resumes. Only the normalisation differs between the two modes of one seed; the seeds say how far apart two runs of
the same mode land (the figure to beat).

Why the shape matters: when a step is one micro-batch (the quickstart: global batch 2 = micro-batch 2) the two
modes differ only by a per-step scalar (real tokens / B x T, near 1 for length-sorted pairs); with many
micro-batches of one sample (the GPU recipes: micro-batch 1), `tokens` weighs samples by their length and
`positions` about equally. Pass `--shape train.micro_batch_size=1 train.global_batch_size=4` for the latter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _last_row(path: Path) -> dict:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    return rows[-1] if rows else {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?")
    p.add_argument("--opts", nargs="*", default=[], help="overrides for every run, data stages included")
    p.add_argument("--shape", nargs="*", default=[], help="training overrides of both modes (e.g. micro-batch 1)")
    p.add_argument("--tag", default="", help="suffix of the run names (one per --shape)")
    p.add_argument("--modes", nargs="+", default=["tokens", "positions"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--split", default="heldout:general")
    p.add_argument("--smoke", action="store_true", help="a tiny random target, one seed, 2 training steps per mode, our "
                   "evaluation on 2 held-out prompts; vLLM is not started: a check of the code path")
    args = p.parse_args()
    if args.smoke:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from _smoke import smoke_env, tiny_recipe

        smoke_env()
        args.seeds, args.split = [0], "heldout"
        args.opts = [*args.opts, "eval.max_samples=2", "eval.max_new_tokens=8"]
        with tempfile.TemporaryDirectory(prefix="smoke_") as tmp:
            args.config = str(tiny_recipe(Path(tmp)))
            return compare(args)
    if args.config is None:
        p.error("give a recipe (or --smoke)")
    return compare(args)


def compare(args) -> int:
    for k, v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("WANDB_MODE", "offline"), ("DEEPSPEC_NO_PROGRESS", "1")):
        os.environ.setdefault(k, v)
    from deepspec.pipeline import run

    t0 = time.monotonic()
    with contextlib.redirect_stdout(sys.stderr):  # the runs' summary tables must not mix with the JSON
        # a smoke's recipe comes with its conversations regenerated
        run([args.config], args.opts, stages=("cache",) if args.smoke else ("prompts", "regenerate", "cache"), engine=False)
    eval_opts = [f"eval.tasks=[{args.split}]", "eval.engine_speedup=false"]
    runs = []
    for seed in args.seeds:
        for mode in args.modes:
            name = f"lossnorm-{mode}-s{seed}" + (f"-{args.tag}" if args.tag else "")
            opts = [*args.opts, *args.shape, *eval_opts, f"run.name={name}", f"train.loss_normalization={mode}", f"train.seed={seed}"]
            with contextlib.redirect_stdout(sys.stderr):
                (rec,) = run([args.config], opts, stages=("train", "eval") if args.smoke else ("train", "eval", "engine"))
            train = next((s for s in rec.stages if s.name == "train"), None)
            cell = ((rec.results or {}).get("engine") or {}).get("tasks", {}).get(args.split) or {}
            ours = ((rec.results or {}).get("tasks") or {}).get(args.split) or {}
            val = _last_row(rec.cfg.run_dir / "val_log.jsonl")
            runs.append({
                "mode": mode, "seed": seed, "run": name, "checkpoint": str(rec.checkpoint),
                "vllm_tau": cell.get("engine_tau"), "ours_tau_at_S": cell.get("ours_tau_at_S"),
                "vllm_acceptance_per_pos": cell.get("engine_survival"), "ours_tau": ours.get("tau"),
                "val": {k: v for k, v in val.items() if "tau" in k or "loss" in k or k == "step"},
                "train_s": None if train is None or train.skipped else train.seconds,
            })
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)

    def mean(mode: str, key: str) -> float | None:
        xs = [r[key] for r in runs if r["mode"] == mode and r[key] is not None]
        return round(statistics.fmean(xs), 4) if xs else None

    by_mode = {m: {"vllm_tau_mean": mean(m, "vllm_tau"), "ours_tau_at_S_mean": mean(m, "ours_tau_at_S")} for m in args.modes}
    spread = [max(xs) - min(xs) for m in args.modes
              if len(xs := [r["vllm_tau"] for r in runs if r["mode"] == m and r["vllm_tau"] is not None]) > 1]
    print(json.dumps({
        **({"smoke": True, "not_run": "vLLM serving each draft (vllm_tau, vllm_acceptance_per_pos)"} if args.smoke else {}),
        "config": args.config, "opts": args.opts, "shape": args.shape, "split": args.split,
        "temperature": 0.0, "runs": runs, "by_mode": by_mode,
        "seed_spread_vllm_tau": round(max(spread), 4) if spread else None,  # two runs of one mode: the noise floor
        "wall_s": round(time.monotonic() - t0, 1),
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
