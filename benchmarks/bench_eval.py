#!/usr/bin/env python
"""Speculative decoding speed and acceptance on the embedded target: prints one JSON object.

    python benchmarks/bench_eval.py CKPT [--tasks gsm8k mt-bench] [--max-samples 8] [--max-new-tokens 128]
    python benchmarks/bench_eval.py --random-draft eagle3   # an untrained draft: measures the loop's overhead

CKPT is a trained draft for SmolLM2-135M-Instruct — `bash scripts/quickstart.sh` produces one
(checkpoints/quickstart-blend/.../step_latest). Without CKPT and without --random-draft nothing is trained:
the script says so and exits 2. Target-only and speculative decoding run in the same process on the
same prompts (greedy, fp32 on CPU), so `speedup` = spec_tokens_per_s / target_tokens_per_s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _emit import emit_json  # noqa: E402


def random_checkpoint(algo: str, out: Path) -> Path:
    """An untrained draft for the embedded target (tau ~ 1: shows the cost of drafting + verifying)."""
    import torch

    from deepspec.config.model import ModelConfig
    from deepspec.drafts.checkpoint import save_draft
    from deepspec.drafts.registry import get_algorithm
    from deepspec.targets import embedded_target_dir
    from transformers import AutoConfig

    tdir = embedded_target_dir()
    torch.manual_seed(0)
    draft = get_algorithm(algo).from_target_config(AutoConfig.from_pretrained(tdir), ModelConfig(algorithm=algo))
    return save_draft(draft, out / "step_0", provenance={"target": "smollm2-135m-instruct", "target_path": str(tdir)})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", nargs="?", help="trained draft checkpoint for the embedded target")
    p.add_argument("--random-draft", default=None, metavar="ALGO", help="benchmark an untrained ALGO draft instead")
    p.add_argument("--tasks", nargs="+", default=["gsm8k", "humaneval", "mt-bench", "alpaca"])
    p.add_argument("--max-samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=None, help="default: the recipe's eval.num_draft_tokens (7)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_eval.json"))
    p.add_argument("--smoke", action="store_true", help="an untrained draft of a tiny random target, 2 gsm8k prompts, 16 new "
                   "tokens, nothing written to benchmarks/results: a check of the code path")
    args = p.parse_args()
    os.environ.setdefault("DEEPSPEC_NO_PROGRESS", "1")
    if args.smoke:
        from _smoke import smoke_env, tiny_recipe, untrained_checkpoint

        smoke_env()
        args.tasks, args.max_samples, args.max_new_tokens = ["gsm8k"], 2, 16
        with tempfile.TemporaryDirectory(prefix="smoke_") as tmp:
            args.checkpoint = str(untrained_checkpoint(tiny_recipe(Path(tmp)), Path(tmp) / "ckpt"))
            args.out = str(Path(tmp) / "bench_eval.json")
            return measure(args)
    return measure(args)


def measure(args) -> int:
    if not args.checkpoint and not args.random_draft:
        print(json.dumps({"error": "no checkpoint given; train one with `bash scripts/quickstart.sh` and pass its "
                                   "step_latest folder (or use --random-draft eagle3 to time an untrained draft)"}))
        return 2
    from deepspec.config import load_config
    from deepspec.eval.runner import evaluate
    from deepspec.log import setup_logging

    setup_logging("WARNING")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.checkpoint) if args.checkpoint else random_checkpoint(args.random_draft, Path(tmp))
        opts = [
            "eval.tasks=[" + ",".join(args.tasks) + "]", f"eval.max_samples={args.max_samples}",
            f"eval.max_new_tokens={args.max_new_tokens}", f"eval.temperature={args.temperature}",
            f"eval.output_dir={Path(tmp) / 'eval'}", "eval.num_workers=1",
            "eval.measure_speedup=true",  # the point of this benchmark, whatever the checkpoint's recipe says
        ]
        if args.num_draft_tokens:
            opts.append(f"eval.num_draft_tokens={args.num_draft_tokens}")
        cfg = load_config(ckpt / "config.yaml" if (ckpt / "config.yaml").is_file() else None, opts)
        t0 = time.time()
        res = evaluate(cfg, ckpt)
    o = res["overall"]
    out = {
        **({"smoke": True} if args.smoke else {}),
        "tau": o["tau"],
        "speedup": o.get("speedup"),
        "target_tokens_per_s": o.get("target_tokens_per_s"),
        "spec_tokens_per_s": o.get("spec_tokens_per_s"),
        "acc_cond": o["acc_cond"],
        "survival": o["survival"],
        "rounds": o["rounds"],
        "generated_tokens": o["spec_tokens"],
        "per_task_tau": {k: v.get("tau") for k, v in res["tasks"].items() if "tau" in v},
        "greedy_outputs_match_target": res.get("greedy_outputs_match_target"),
        "checkpoint": str(args.checkpoint or f"random {args.random_draft} draft"),
        "algorithm": res["meta"]["algorithm"],
        "target": res["meta"]["target"]["target"],
        "num_draft_tokens": res["meta"]["num_draft_tokens"],
        "tasks": args.tasks, "max_samples": args.max_samples, "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "device": res["meta"]["devices"][0], "torch_threads": __import__("torch").get_num_threads(),
        "wall_seconds": time.time() - t0,
    }
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
