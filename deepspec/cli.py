"""The `deepspec` command: one subcommand per pipeline stage.

Each stage module provides ``add_arguments(parser)`` and ``main(args) -> int``; they are
imported only when the parser is built and must not import torch at module level, so
``deepspec --help`` stays fast and works without GPU packages.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from deepspec import __version__
from deepspec.errors import DeepSpecError

# (command words, module, one-line help)
STAGES: list[tuple[tuple[str, ...], str, str]] = [
    (("data", "prompts"), "deepspec.data.prompts_cli", "collect prompts into conversations.jsonl + a held-out split"),
    (("data", "regenerate"), "deepspec.data.regenerate_cli", "have the target re-answer the prompts (vLLM / OpenAI servers / HF)"),
    (("data", "cache"), "deepspec.data.cache.cli", "cache the target's hidden states for offline training"),
    (("data", "stream"), "deepspec.data.stream.cli", "feed a streamed run (cache.mode=stream): the target's hidden states through a bounded spool"),
    (("train",), "deepspec.train.cli", "train a draft model (one process; use scripts/train/train.sh for many workers)"),
    (("eval",), "deepspec.eval.cli", "speculative decoding on benchmarks: tau, per-depth acceptance, speedup"),
    (("export",), "deepspec.export.cli", "write a draft checkpoint that vLLM / SGLang serve unchanged"),
    (("check",), "deepspec.export.check_cli", "find the first divergence between an export and its draft in the engines' own model code"),
    (("run",), "deepspec.pipeline", "run every stage of a recipe, skipping finished ones"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepspec",
        description="Train, evaluate and export speculative-decoding draft models (EAGLE-3/3.1, DFlash, DFlash2, DSpark).",
        epilog="Stages: data prompts -> data regenerate -> data cache -> train -> eval -> export; `run` chains them.",
    )
    parser.add_argument("--version", action="version", version=f"deepspec {__version__}")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for words, module_name, help_text in STAGES:
        module = importlib.import_module(module_name)
        if len(words) == 2:
            if words[0] not in groups:
                group_parser = top.add_parser(words[0], help="data stages: data prompts | data regenerate | data cache | data stream")
                groups[words[0]] = group_parser.add_subparsers(dest="subcommand", metavar="STAGE")
            sub = groups[words[0]].add_parser(words[1], help=help_text, description=help_text)
        else:
            sub = top.add_parser(words[0], help=help_text, description=help_text)
        module.add_arguments(sub)
        sub.set_defaults(_main=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    from deepspec.log import get_logger, setup_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    if not hasattr(args, "_main"):
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args._main(args) or 0)
    except DeepSpecError as e:
        get_logger("cli").error("%s", e)
        print(f"deepspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("deepspec: interrupted; rerun the same command to resume.", file=sys.stderr)
        return 130


def entry() -> None:
    """The `deepspec` command: main(), then the process exits without the interpreter's final collection."""
    from deepspec.exiting import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()
