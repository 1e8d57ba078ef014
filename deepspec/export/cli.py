"""`deepspec export CKPT --format vllm|sglang [--out DIR] [--target T] [--push-to-hub REPO_ID]`: write an engine-loadable
draft folder with its model card (README.md), and optionally upload it.

Before the folder is put in place, `deepspec check` (export/check.py) pushes fixed samples through the draft and
through the engine's own model code; an export that diverges is not written (one sentence names the first mismatch
and its likely cause) unless --skip-check. When the engine's code is not at hand the check is skipped with a log line."""

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
    parser.add_argument("--calibration", default=None,
                        help="DSpark: a calibration.json (python -m deepspec.eval.calibration) whose global scaling is baked into the confidence head")
    parser.add_argument("--contract-prompts", type=int, default=None, metavar="N",
                        help="eval prompts per split stored in served_contract.json for `deepspec check --served` (default 16)")
    parser.add_argument("--skip-check", action="store_true",
                        help="do not run `deepspec check` before writing (logs a warning): the export is written even if it diverges from the draft")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", default=None, help="upload the export folder to this model repository")
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository as private")
    parser.add_argument("--revision", default=None, help="with --push-to-hub: branch to upload to (default: the main branch)")


def _checked(staged: Path, ckpt: Path, fmt: str, skip: bool) -> None:
    """Run the engine check on the staged export; raise when it diverges (unless `skip`), log when it cannot run."""
    from deepspec.errors import CheckpointError
    from deepspec.export.check import check_export
    from deepspec.log import get_logger

    log = get_logger(__name__)
    if skip:
        log.warning("!!! --skip-check: this export is NOT checked against %s's model code; it may not run as trained.", fmt)
        return
    try:
        report = check_export(staged, (fmt,), checkpoint=ckpt)
    except Exception as e:  # noqa: BLE001 - a check that cannot run must not break export
        log.warning("export check skipped: it could not run (%s: %s)", type(e).__name__, e)
        return
    ec = report.engines[0]
    if ec.status == "skipped":
        log.warning("export check skipped for %s: %s", fmt, ec.reason)
    elif ec.status == "pass":
        log.info("export check passed: %s's %s computes what the draft computes at every stage (%d stages)",
                 fmt, ec.engine_class, len(ec.rows))
    else:
        raise CheckpointError(f"Export refused, nothing written: {ec.reason[0].upper()}{ec.reason[1:]} "
                              "Fix the export (or pass --skip-check to write it anyway).")


def main(args: argparse.Namespace) -> int:
    import shutil
    import uuid

    from deepspec.export.writers import export_draft, swap_in
    from deepspec.locks import folder_lock
    from deepspec.log import get_logger

    ckpt = Path(args.checkpoint).resolve() if Path(args.checkpoint).exists() else Path(args.checkpoint)
    out = Path(args.out) if args.out else ckpt.parent / f"{ckpt.name}-{args.fmt}"
    # written beside `out` under the same name (the model card names the folder), checked, then moved into place
    stage_dir = out.parent / f".{out.name}.check-{uuid.uuid4().hex[:8]}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with folder_lock(out, "export"):  # a second export to the same folder stops at once, naming this one
        try:
            staged = export_draft(ckpt, stage_dir / out.name, args.fmt, target=args.target, dtype=args.dtype,
                                  num_speculative_tokens=args.num_speculative_tokens, eval_results=args.eval_results,
                                  calibration=args.calibration, contract_prompts=args.contract_prompts)
            _checked(staged, ckpt, args.fmt, args.skip_check)
            swap_in(staged, out)
        finally:
            shutil.rmtree(stage_dir, ignore_errors=True)
    path = out
    get_logger(__name__).info("exported %s -> %s (%s)", args.checkpoint, path, args.fmt)
    if args.push_to_hub:
        from deepspec.export.hub import push_to_hub

        url = push_to_hub(path, args.push_to_hub, private=args.private, revision=args.revision)
        get_logger(__name__).info("uploaded %s to %s", path, url)
    print(path)
    return 0
