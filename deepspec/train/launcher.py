"""Starting N training workers from Python (the pipeline runner, tests): torchrun in a subprocess.

`bash scripts/train/train.sh` does the same from a shell and passes multi-node arguments through.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from deepspec.errors import DeepSpecError


def torchrun_command(config_path: str | Path, nproc: int, opts: Sequence[str] = (), torchrun_args: Sequence[str] = ()) -> list[str]:
    """The torchrun command line for `nproc` workers on this node (standalone unless rdzv args are given)."""
    rdzv = any(a.startswith(("--nnodes", "--rdzv", "--master", "--node")) for a in torchrun_args)
    cmd = [sys.executable, "-m", "torch.distributed.run", *([] if rdzv else ["--standalone"]), f"--nproc-per-node={nproc}", *torchrun_args]
    cmd += ["-m", "deepspec.train.worker", str(config_path)]
    if opts:
        cmd += ["--opts", *opts]
    return cmd


def cpu_threads_per_worker(nproc: int) -> int:
    """torch threads for each of `nproc` workers on this node. torchrun would pin every worker to one
    thread; workers share the usable cores instead — on GPU nodes too, where a rank's host-side copies
    (pinning, collation) and its loader processes need more than one core."""
    from deepspec.cpus import threads_per_worker

    return threads_per_worker(nproc)


def launch(cfg, nproc: int, torchrun_args: Sequence[str] = (), env: dict[str, str] | None = None) -> Path:
    """Train `cfg` on `nproc` workers (torchrun subprocess); returns the final checkpoint directory.

    The resolved config is written to <run_dir>/launch_config.yaml and passed to every worker
    with the original overrides, so the run name (and run_dir) is the same as in this process.
    """
    from deepspec.config import save_config
    from deepspec.train.checkpoint import latest_step_dir

    if nproc < 1:
        raise DeepSpecError(f"nproc must be >= 1, got {nproc}.")
    run_dir = Path(cfg.run_dir)
    path = save_config(cfg, run_dir, name="launch_config.yaml")
    cmd = torchrun_command(path, nproc, cfg.overrides, torchrun_args)
    run_env = dict(os.environ, **(env or {}))
    run_env.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_worker(nproc)))
    # A wandb run in this process leaves WANDB_SERVICE pointing at its service; workers must start their own.
    run_env.pop("WANDB_SERVICE", None)
    rc = subprocess.call(cmd, env=run_env)
    if rc != 0:
        raise DeepSpecError(f"Training workers failed (exit code {rc}); see the log above, fix the cause and rerun to resume.")
    out = latest_step_dir(run_dir)
    if out is None:
        raise DeepSpecError(f"Training finished but wrote no checkpoint under {run_dir}.")
    return out
