"""`deepspec data regenerate CONFIG`: the target re-answers the prompts (vLLM / OpenAI servers / HF)."""

from __future__ import annotations

import argparse
import json

from deepspec.config.args import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--engine", choices=["auto", "vllm", "openai", "hf"], default=None,
                        help="override data.regenerate.engine (auto: openai if URLs are given, else vllm, else hf)")
    parser.add_argument("--urls", nargs="+", default=None, metavar="URL",
                        help="OpenAI-compatible server base URLs (http://host:port[/v1]); implies --engine openai under auto")
    parser.add_argument("--urls-file", default=None, help="file with one server URL per line (scripts/data/launch_vllm_servers.sh writes it)")
    parser.add_argument("--split", choices=["all", "train", "heldout"], default="all",
                        help="which split to regenerate (all = train, plus held-out when data.regenerate.heldout)")
    parser.add_argument("--overwrite", action="store_true", help="discard existing output and regenerate from scratch")


def main(args: argparse.Namespace) -> int:
    from deepspec.data.regenerate import regenerate

    cfg = config_from_args(args)
    if args.urls_file:
        cfg.data.regenerate.urls_file = args.urls_file
    summary = regenerate(cfg, engine=args.engine, urls=args.urls, overwrite=args.overwrite, which=args.split)
    print(json.dumps({k: summary[k] for k in ("engine", "done", "skipped", "failed", "permanent_failures", "output_tokens")}))
    retryable = summary["failed"] - summary["permanent_failures"]
    if retryable:
        print(f"deepspec: {retryable} conversation(s) failed; rerun the same command to retry them.")
        return 1
    return 0
