"""Starting N training workers from Python (the pipeline runner, tests): torchrun in a subprocess.

`bash scripts/train/train.sh` does the same from a shell and passes multi-node arguments through. Both run torchrun
through this module (`python -m deepspec.train.launcher TORCHRUN_ARGS...`), which makes preemption graceful: SIGTERM
and SIGUSR1 reach every worker (torchrun alone dies on SIGUSR1 and leaves its workers behind), torchrun waits
`DEEPSPEC_PREEMPT_GRACE_S` seconds for them to checkpoint, and a preempted run ends with one line and status
128 + the signal's number instead of torchrun's traceback (deepspec/preemption.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from deepspec.errors import DeepSpecError

PREEMPTED_CODES = {128 + signal.SIGTERM, 128 + signal.SIGUSR1}


def torchrun_command(config_path: str | Path, nproc: int, opts: Sequence[str] = (), torchrun_args: Sequence[str] = ()) -> list[str]:
    """The torchrun command line for `nproc` workers on this node (standalone unless rdzv args are given)."""
    rdzv = any(a.startswith(("--nnodes", "--rdzv", "--master", "--node")) for a in torchrun_args)
    cmd = [sys.executable, "-m", "deepspec.train.launcher", *([] if rdzv else ["--standalone"]), f"--nproc-per-node={nproc}", *torchrun_args]
    cmd += ["-m", "deepspec.train.worker", str(config_path)]
    if opts:
        cmd += ["--opts", *opts]
    return cmd


def cpu_threads_per_worker(nproc: int) -> int:
    """torch threads for each of `nproc` workers on this node. torchrun would pin every worker to one
    thread; CPU workers share the usable cores instead (on GPU one thread each is enough)."""
    import torch

    from deepspec.cpus import threads_per_worker

    return 1 if torch.cuda.is_available() else threads_per_worker(nproc)


def launch(cfg, nproc: int, torchrun_args: Sequence[str] = (), env: dict[str, str] | None = None) -> Path:
    """Train `cfg` on `nproc` workers (torchrun subprocess); returns the final checkpoint directory.

    The resolved config is written to <run_dir>/launch_config.yaml and passed to every worker
    with the original overrides, so the run name (and run_dir) is the same as in this process.
    SIGTERM / SIGUSR1 sent to this process are passed on; a preempted run raises Preempted (exit 128 + signal).
    """
    from deepspec.config import save_config
    from deepspec.train.checkpoint import check_resume_settings, latest_step_dir
    from deepspec.preemption import Preempted

    if nproc < 1:
        raise DeepSpecError(f"nproc must be >= 1, got {nproc}.")
    run_dir = Path(cfg.run_dir)
    previous = latest_step_dir(run_dir) if cfg.train.resume else None
    if previous is not None:
        check_resume_settings(cfg, previous)  # here, once, before N workers each print the same refusal
    path = save_config(cfg, run_dir, name="launch_config.yaml")
    cmd = torchrun_command(path, nproc, cfg.overrides, torchrun_args)
    run_env = dict(os.environ, **(env or {}))
    run_env.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_worker(nproc)))
    # A wandb run in this process leaves WANDB_SERVICE pointing at its service; workers must start their own.
    run_env.pop("WANDB_SERVICE", None)
    rc = _call_forwarding_signals(cmd, run_env)
    if rc in PREEMPTED_CODES:
        latest = latest_step_dir(run_dir)
        raise Preempted(rc - 128, int(latest.name.split("_")[-1]) if latest else 0)
    if rc != 0:
        raise DeepSpecError(f"Training workers failed (exit code {rc}); see the log above, fix the cause and rerun to resume.")
    out = latest_step_dir(run_dir)
    if out is None:
        raise DeepSpecError(f"Training finished but wrote no checkpoint under {run_dir}.")
    return out


def _call_forwarding_signals(cmd: list[str], env: dict[str, str]) -> int:
    """subprocess.call that passes SIGTERM / SIGUSR1 on to the child (Python's default would die and orphan it)."""
    proc = subprocess.Popen(cmd, env=env)
    previous = {}
    import threading

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            previous[sig] = signal.signal(sig, lambda signum, frame: proc.send_signal(signum))
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_torchrun(argv: Sequence[str]) -> int:
    """torchrun with graceful preemption: SIGUSR1 handled like SIGTERM and forwarded to the workers, a grace period
    of DEEPSPEC_PREEMPT_GRACE_S seconds, and one line (no traceback) when the workers stopped on a signal."""
    from deepspec.preemption import grace_seconds

    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(grace_seconds()))
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(list(argv))
    except SignalException as e:
        code = 128 + int(e.sigval)
        print(f"deepspec: stopped by {signal.Signals(e.sigval).name}; the workers checkpointed their last step; "
              f"rerun the same command to resume (exit status {code}).", file=sys.stderr)
        return code
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        # a rank that exits first (its checkpoint is complete: saving ends in a barrier) makes torchrun SIGTERM / SIGKILL
        # the ranks still tearing down; those are part of the same preemption, not a failure of their own
        torn_down = {-signal.SIGTERM, -signal.SIGKILL}
        if codes & PREEMPTED_CODES and codes <= PREEMPTED_CODES | torn_down:
            codes &= PREEMPTED_CODES
            code = max(codes)
            print(f"deepspec: the workers were stopped by {signal.Signals(code - 128).name} and checkpointed their last "
                  f"step; rerun the same command to resume (exit status {code}).", file=sys.stderr)
            return code
        if 2 in codes:  # a worker's DeepSpecError: its one-sentence message is already printed above
            print("deepspec: a training worker stopped with the error printed above (exit status 2).", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    from deepspec.exiting import exit_process

    exit_process(run_torchrun(sys.argv[1:]))
