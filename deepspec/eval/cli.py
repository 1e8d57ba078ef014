"""`deepspec eval CKPT`: speculative decoding of a draft checkpoint on the benchmarks.

Flags are shortcuts for `eval.*` config fields (`--opts` can set any field); the target comes from
the checkpoint's provenance unless `--target` / `--opts target.name=...` says otherwise.
No torch import at module level (the CLI builds every stage's parser).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deepspec.config.args import add_config_arguments
from deepspec.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="draft checkpoint folder (e.g. checkpoints/<project>/<exp>/step_latest)")
    add_config_arguments(parser, config_required=False)
    parser.add_argument("--tasks", nargs="+", default=None, help="benchmarks (default: all 9): gsm8k math500 aime25 humaneval mbpp livecodebench mt-bench alpaca "
                        "arena-hard-v2; also heldout, heldout:<split>, or a path to your own .jsonl / .json prompts")
    parser.add_argument("--max-samples", type=int, default=None, help="samples per benchmark (default: DeepSpec's caps)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    parser.add_argument("--draft-sample-method", choices=["probabilistic", "greedy"], default=None,
                        help="how drafts are drawn at T > 0: probabilistic (default; the papers' protocol) or greedy "
                        "(argmax drafts, vLLM's default); the engine-backed eval uses the same")
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="draft tokens per verify round")
    parser.add_argument("--nproc", type=int, default=None, help="workers (default: one per GPU, 1 on CPU)")
    parser.add_argument("--target", default=None, help="override the target from the checkpoint's provenance")
    parser.add_argument("--engine", choices=["none", "vllm"], default=None, help="also measure the exported draft inside vLLM")
    parser.add_argument("--output-dir", default=None, help="default: <checkpoint>/eval")
    parser.add_argument("--run-dir", default=None, help="training run folder: log eval/* scalars to its tensorboard / wandb")
    parser.add_argument("--step", type=int, default=None, help="step for --run-dir logging (default: from the folder name step_N)")
    parser.add_argument("--no-speedup", action="store_true", help="skip the target-only timing baseline")


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """Turn the convenience flags into `--opts` entries (so they are typed and recorded like any override)."""
    opts = []
    if args.tasks:
        opts.append("eval.tasks=[" + ",".join(args.tasks) + "]")
    for flag, key in (("max_samples", "max_samples"), ("max_new_tokens", "max_new_tokens"), ("temperature", "temperature"),
                      ("draft_sample_method", "draft_sample_method"),
                      ("num_draft_tokens", "num_draft_tokens"), ("nproc", "num_workers"), ("engine", "engine"),
                      ("output_dir", "output_dir")):
        v = getattr(args, flag)
        if v is not None:
            opts.append(f"eval.{key}={v}")
    if args.no_speedup:
        opts.append("eval.measure_speedup=false")
    if args.target:
        opts.append(f"target.name={args.target}")
    return opts


def load_eval_config(args: argparse.Namespace):
    """--config if given, else the config.yaml stored with the checkpoint (if any), else defaults; then overrides."""
    from deepspec.config import load_config

    ckpt = Path(args.checkpoint)
    if not ckpt.is_dir():
        raise ConfigError(f"Checkpoint folder {ckpt} does not exist; pass a draft checkpoint such as checkpoints/<project>/<exp>/step_latest.")
    config = args.config
    if config is None and (ckpt / "config.yaml").is_file():
        config = ckpt / "config.yaml"
    return load_config(config, list(args.opts or []) + flag_overrides(args))


def main(args: argparse.Namespace) -> int:
    import re

    from deepspec.eval.runner import evaluate

    cfg = load_eval_config(args)
    step = args.step
    if step is None:
        m = re.search(r"step_(\d+)$", str(Path(args.checkpoint).resolve()))
        step = int(m.group(1)) if m else 0
    evaluate(cfg, args.checkpoint, output_dir=args.output_dir, run_dir=args.run_dir, step=step)
    return 0
