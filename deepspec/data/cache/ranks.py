"""The processes of a cache build: CPU workers spawned as torchrun ranks would be, and the barrier between ranks.

Why apart from the build: spawning, signal forwarding and the gloo group are the same whatever a rank builds; the
build (writer.py) hands in the function each worker runs.
"""

from __future__ import annotations

import os

from deepspec.errors import CacheError
from deepspec.preemption import Preempted, stop_on_signals


def free_port() -> int:
    """A free TCP port on this host for the spawned workers' rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawned_worker(rank: int, world: int, port: int, cfg, split: str, threads: int, build) -> None:
    """One CPU worker: joins a gloo group exactly as a torchrun rank would, then runs the same path (`build(cfg, split)`)."""
    import torch

    from deepspec.log import setup_logging

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["DEEPSPEC_CACHE_DEVICE"] = "cpu"
    setup_logging()
    torch.set_num_threads(threads)
    try:
        build(cfg, split)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_workers(mp, nproc: int, args: tuple) -> None:
    """mp.spawn of `spawned_worker` (`args`: its arguments after the rank), passing SIGTERM / SIGUSR1 on to the workers (each discards its partial shard) before exiting."""
    ctx = mp.spawn(spawned_worker, args=args, nprocs=nproc, join=False)
    try:
        with stop_on_signals("cache", lambda: "complete shards are kept"):
            while not ctx.join():
                pass
    except mp.ProcessExitedException as e:  # killed (the OOM killer, a kill -9) or died without a Python error
        how = f"was killed by {e.signal_name}" if e.signal_name else f"exited with status {e.exit_code}"
        raise CacheError(f"Cache worker {e.error_index} (pid {e.error_pid}) {how}"
                         + (" (SIGKILL is often the out-of-memory killer: see `dmesg`)" if e.signal_name == "SIGKILL" else "")
                         + "; the other workers were stopped and every complete shard is kept: rerun the same command to "
                           "continue.") from None
    except Preempted as e:
        for proc in ctx.processes:
            if proc.is_alive():
                os.kill(proc.pid, e.signum)
        for proc in ctx.processes:
            proc.join(60)
        raise


def barrier() -> None:
    """Barriers between cache workers. The group only ever synchronises (no tensors), so it is gloo on any machine:
    NCCL would tie each rank to a GPU, and `--nproc N` CPU workers on a GPU machine all map to the same one."""
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        # ranks that finish their shards wait at the last barrier for the slowest one: hours at scale, not
        # the default 30 minutes
        hours = float(os.environ.get("DEEPSPEC_CACHE_BARRIER_HOURS", "72"))
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=hours))
    dist.barrier()
