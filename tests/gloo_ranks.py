"""Real gloo ranks as subprocesses, each running a `python -c` script with RANK / WORLD_SIZE / MASTER_* set as torchrun
would (the script calls `init_gloo`, importable there): for tests of what one rank does while another waits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def start_ranks(script: str, *argv: str, env: dict[str, str], world: int = 2) -> list[subprocess.Popen]:
    from deepspec.data.engines.server import free_port

    path = os.pathsep.join(p for p in (str(Path(__file__).parent), env.get("PYTHONPATH", "")) if p)  # init_gloo
    env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world), PYTHONPATH=path)
    return [subprocess.Popen([sys.executable, "-c", script, *argv], env={**env, "RANK": str(r)}, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(world)]


def outputs(ranks: list[subprocess.Popen], timeout: float) -> list[str]:
    """Each rank's stdout, stripped, once every rank has ended (any still running after `timeout` is killed)."""
    try:
        return [p.communicate(timeout=timeout)[0].strip() for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()


def init_gloo(timeout_s: float | None = None) -> None:
    """In a rank: the default gloo group, whose collectives time out after `timeout_s` seconds (None: torch's default),
    made once every rank has arrived. The ranks' imports take different times on a busy machine; the rendezvous (the
    store's, before the group is made) waits for the last one with two minutes' patience, so a test's timeout of
    seconds bears on the collectives it tests, never on a rank that started late."""
    import datetime

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # rank 0's store waits here until every rank has connected to it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, **timeout)
