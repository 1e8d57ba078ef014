"""`deepspec check EXPORT [--engine vllm|sglang|all] [--json] [--allow-unchecked]`: find the first divergence between an
export and its draft in the engines' own model code (export/check.py). Exit 1 when it diverges; 3 when an engine the
export is laid out for could not run here (not checked: the report says why and what to do), unless --allow-unchecked;
else 0.

`deepspec check EXPORT --served URL [--json]`: send the export's contract prompts to a running vLLM server serving the
target with this draft and compare its per-position acceptance with the contract's (export/served.py). Exit 0 when
it matches within the stated band, 1 when a position falls outside (named), 2 when the check cannot be made."""

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
    parser.add_argument("--served", metavar="URL", default=None,
                        help="instead: check a running vLLM server (http://HOST:PORT) serving the target with this draft against "
                             "the export's served_contract.json (exit 0 match, 1 mismatch, 2 cannot check)")
    parser.add_argument("--served-concurrency", type=int, default=8, help="with --served: requests in flight (default 8)")


def main(args: argparse.Namespace) -> int:
    if args.served:
        from deepspec.export.served import main as served_main

        return served_main(args)
    from deepspec.export.check import ENGINES, check_export

    engines = ENGINES if args.engine == "all" else (args.engine,)
    report = check_export(args.export, engines, checkpoint=args.checkpoint)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.table())
    return 1 if report.diverged else 3 if report.unchecked and not args.allow_unchecked else 0
