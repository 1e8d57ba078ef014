"""`deepspec data prompts CONFIG`: collect prompts into conversations.jsonl + a held-out split."""

from __future__ import annotations

import argparse

from deepspec.config.args import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--strict", action="store_true", help="refuse the source if any record is invalid (default: skip and count)")
    parser.add_argument("--overwrite", action="store_true", help="rebuild even if the output is complete")


def main(args: argparse.Namespace) -> int:
    from deepspec.data.prompts import build_prompts

    cfg = config_from_args(args)
    build_prompts(cfg, strict=True if args.strict else None, overwrite=args.overwrite)
    return 0
