"""`deepspec export CKPT --format vllm|sglang [--out DIR] [--target T]`: write an engine-loadable draft."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a deepspec draft checkpoint folder (e.g. checkpoints/<project>/<exp>/step_latest)")
    parser.add_argument("--format", dest="fmt", choices=["vllm", "sglang"], default="vllm", help="engine layout (default vllm)")
    parser.add_argument("--out", default=None, help="output folder (default: <checkpoint>-<format>)")
    parser.add_argument(
        "--target", default=None,
        help="target folder or embedded name to check the checkpoint against (default: the target path recorded in the checkpoint)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="weight dtype of the export")


def main(args: argparse.Namespace) -> int:
    from deepspec.export.writers import export_draft
    from deepspec.log import get_logger

    ckpt = Path(args.checkpoint).resolve() if Path(args.checkpoint).exists() else Path(args.checkpoint)
    out = Path(args.out) if args.out else ckpt.parent / f"{ckpt.name}-{args.fmt}"
    path = export_draft(ckpt, out, args.fmt, target=args.target, dtype=args.dtype)
    get_logger(__name__).info("exported %s -> %s (%s)", args.checkpoint, path, args.fmt)
    print(path)
    return 0
