#!/usr/bin/env python
"""DSpark confidence calibration, priced as vLLM's adaptive verification uses it: prints one JSON object.

    python benchmarks/bench_calibration.py --checkpoint CKPT [--tasks heldout gsm8k] [--max-samples 8]
    python benchmarks/bench_calibration.py --recipe config/quickstart/dspark.yaml [--opts train.max_steps=100 ...]
    python benchmarks/bench_calibration.py --smoke     # a tiny Qwen3 target, a DSpark trained 4 steps: seconds
    python benchmarks/bench_calibration.py --checkpoint CKPT --rounds CKPT/eval/calibration_rounds.jsonl   # refit only

The checkpoint's own evaluator decodes the prompts at T = 0 and T = 1 (deepspec/eval/calibration.py), recording each
round's confidence logits and accepted drafts. Per temperature the JSON has per-position ECE (equal-mass bins) on the
evaluation split before and after the scaling fitted on a disjoint split (the raw head, one global pair or per-position
pairs shrunk towards it, chosen by cross-validation over the fit split's answers), the global pair an export can bake,
and the admission replay: vLLM's slot admission (global top-k of survival probabilities under a
draft budget) with raw, calibrated, global-only and oracle scores, as accepted drafts per verified slot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _emit import emit_json  # noqa: E402


def smoke_checkpoint(root: Path) -> tuple[Path, list[str]]:
    """A DSpark draft trained 4 steps on a tiny random Qwen3 target (the tests' tiny recipe) and eval overrides that
    point at six short prompts."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_recipe import cached_recipe

    from deepspec.config import load_config
    from deepspec.targets import save_tiny_target
    from deepspec.train import train

    target = save_tiny_target(root / "target", "qwen3")
    recipe = cached_recipe(root, target, samples=8, heldout=2, max_length=96, project="cal",
                           model="algorithm: dspark, block_size: 4, num_anchors: 8, markov_rank: 8, mask_token_id: 259",
                           train="optimizer: adamw, lr: 3.0e-3, global_batch_size: 2, micro_batch_size: 1, max_steps: 4, "
                                 "save_every: 4, val_every: 4, log_every: 1, precision: fp32")
    ckpt = train(load_config(recipe))
    d = root / "prompts"
    d.mkdir()
    words = "the cat sat on a mat and then ran far away".split()
    (d / "gsm8k.jsonl").write_text("".join(json.dumps({"turns": [" ".join(words[i:] + words[:i])]}) + "\n" for i in range(6)))
    return ckpt, [f"eval.datasets_dir={d}", "eval.tasks=[gsm8k]", "eval.max_new_tokens=16", "eval.num_draft_tokens=3"]


def summary(report: dict, checkpoint: Path, mode: str) -> dict:
    """The figures a reader compares: ECE per position before / after, the fitted pairs, the replay table."""
    out = {"smoke": mode == "smoke", "mode": mode, "checkpoint": str(checkpoint), "bins": report["bins"], "binning": report["binning"],
           "label": report["label"], "split": report["split"], "selection": report["selection"], "bake": report["bake"],
           "temperatures": {}}
    for t, v in report["temperatures"].items():
        out["temperatures"][t] = {
            "rounds": v["rounds"], "pairs_per_position_eval": v["pairs_per_position"]["eval"],
            "acceptance_observed": v["acceptance_observed"], "mean_confidence_raw": v["mean_confidence_raw"],
            "ece_raw": v["ece_raw"], "ece_calibrated": v["ece_calibrated"], "ece_global_only": v["ece_global_only"],
            "ece_global_fit": v["ece_global_fit"], "ece_all_positions": v["ece_all_positions"], "with_pair_of": v["with_pair_of"],
            "scaling": {k: v["scaling"][k] for k in ("a", "b", "global_a", "global_b", "fallback", "method", "shrinkage",
                                                      "global_fit", "cv_nll", "cv_answers")},
            "admission_replay": v["admission_replay"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", help="a trained DSpark checkpoint (its config.yaml is the recipe)")
    p.add_argument("--recipe", help="train this DSpark recipe first (with --opts), then calibrate its last step")
    p.add_argument("--opts", nargs="*", default=[], help="recipe overrides (key=value), for training and the eval prompts")
    p.add_argument("--smoke", action="store_true", help="tiny target, 4 training steps, 6 prompts: a check of the path")
    p.add_argument("--tasks", nargs="+", default=None, help="eval tasks (default: the recipe's)")
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--bins", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="concurrent requests per replayed engine step")
    p.add_argument("--budgets", default="1,2,3,4", help="draft slots per request the replayed steps may verify")
    p.add_argument("--rounds", default=None, help="with --checkpoint: refit from the calibration_rounds.jsonl a run wrote, without decoding")
    p.add_argument("--bake-temperature", type=float, default=None,
                   help="the temperature whose global pair calibration.json marks for baking (default: the highest measured)")
    p.add_argument("--out", default=None, help="also write the JSON here (calibration.json/png go beside the checkpoint's eval)")
    args = p.parse_args(argv)
    os.environ.setdefault("DEEPSPEC_NO_PROGRESS", "1")
    if sum(bool(x) for x in (args.checkpoint, args.recipe, args.smoke)) != 1:
        print(json.dumps({"error": "give exactly one of --checkpoint CKPT, --recipe CONFIG or --smoke"}))
        return 2
    import torch

    from deepspec.config import load_config
    from deepspec.eval.calibration import calibrate, load_rounds

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="bench-calibration-") as tmp:
        extra = list(args.opts)
        if args.smoke:
            ckpt, eval_opts = smoke_checkpoint(Path(tmp))
            extra = eval_opts + extra
            mode = "smoke"
        elif args.recipe:
            from deepspec.train import train

            ckpt, mode = train(load_config(args.recipe, list(args.opts))), "trained"
        else:
            ckpt, mode = Path(args.checkpoint), "checkpoint"
        for flag, key in ((args.tasks, "eval.tasks"), (args.max_samples, "eval.max_samples"),
                          (args.max_new_tokens, "eval.max_new_tokens"), (args.num_draft_tokens, "eval.num_draft_tokens")):
            if flag is not None:
                extra.append(f"{key}=[{','.join(flag)}]" if isinstance(flag, list) else f"{key}={flag}")
        cfg = load_config(str(Path(ckpt) / "config.yaml"), extra + ["logging.wandb=false"])
        out_dir = Path(tmp) / "calibration" if args.smoke or args.rounds else Path(ckpt) / "eval"
        report = calibrate(cfg, ckpt, out_dir, temperatures=[float(t) for t in args.temperatures.split(",")], bins=args.bins,
                           batch_size=args.batch_size, budgets_per_request=[float(b) for b in args.budgets.split(",")],
                           rounds=load_rounds(args.rounds) if args.rounds else None, bake_temperature=args.bake_temperature)
        res = summary(report, Path(ckpt), mode)
        res["files"] = {"json": str(out_dir / "calibration.json"), "png": str(out_dir / "calibration.png"),
                        "png_written": (out_dir / "calibration.png").is_file(), "rounds": args.rounds}
        res["eval"] = {"tasks": list(cfg.eval.tasks), "max_samples": cfg.eval.max_samples, "max_new_tokens": cfg.eval.max_new_tokens,
                       "num_draft_tokens": cfg.eval.num_draft_tokens, "draft_sample_method": cfg.eval.draft_sample_method}
    emit_json(res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
