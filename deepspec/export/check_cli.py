"""`deepspec check EXPORT [--engine vllm|sglang|all] [--json] [--allow-unchecked]`: find the first divergence between an
export and its draft in the engines' own model code (export/check.py). Exit 1 when it diverges; 3 when an engine the
export is laid out for could not run here (not checked: the report says why and what to do), unless --allow-unchecked;
else 0."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("export", help="an export folder written by `deepspec export`")
    parser.add_argument("--checkpoint", default=None, help="the draft checkpoint to compare with (default: the export's source_checkpoint)")
    parser.add_argument("--target", default=None, help="accepted for symmetry with `deepspec export`; the check feeds seeded random target "
                                                       "states and embeddings to both sides, so no target is loaded")
    parser.add_argument("--engine", choices=["vllm", "sglang", "all"], default="all", help="whose model code to compare with (default all)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--allow-unchecked", action="store_true",
                        help="exit 0 when the engine the export is laid out for cannot run here (default: exit 3, not checked)")


def main(args: argparse.Namespace) -> int:
    from deepspec.export.check import ENGINES, check_export

    engines = ENGINES if args.engine == "all" else (args.engine,)
    report = check_export(args.export, engines, checkpoint=args.checkpoint)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.table())
    return 1 if report.diverged else 3 if report.unchecked and not args.allow_unchecked else 0
