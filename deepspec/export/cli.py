"""`deepspec export CKPT --format vllm|sglang [--out DIR] [--target T] [--push-to-hub REPO_ID]`: write an engine-loadable
draft folder with its model card (README.md), and optionally upload it."""

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
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="tokens per round the export is served with (DFlash: must be block_size - 1, the default)")
    parser.add_argument("--eval-results", default=None,
                        help="eval results.json the model card reports (default: <checkpoint>/eval/results.json)")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", default=None, help="upload the export folder to this model repository")
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository as private")
    parser.add_argument("--revision", default=None, help="with --push-to-hub: branch to upload to (default: the main branch)")


def main(args: argparse.Namespace) -> int:
    from deepspec.export.writers import export_draft
    from deepspec.log import get_logger

    ckpt = Path(args.checkpoint).resolve() if Path(args.checkpoint).exists() else Path(args.checkpoint)
    out = Path(args.out) if args.out else ckpt.parent / f"{ckpt.name}-{args.fmt}"
    path = export_draft(ckpt, out, args.fmt, target=args.target, dtype=args.dtype,
                        num_speculative_tokens=args.num_speculative_tokens, eval_results=args.eval_results)
    get_logger(__name__).info("exported %s -> %s (%s)", args.checkpoint, path, args.fmt)
    if args.push_to_hub:
        from deepspec.export.hub import push_to_hub

        url = push_to_hub(path, args.push_to_hub, private=args.private, revision=args.revision)
        get_logger(__name__).info("uploaded %s to %s", path, url)
    print(path)
    return 0
