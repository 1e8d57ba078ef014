"""Real gloo ranks as subprocesses, each running a `python -c` script with RANK / WORLD_SIZE / MASTER_* set as torchrun
would (the script calls `dist.init_process_group("gloo")`): for tests of what one rank does while another waits."""

from __future__ import annotations

import subprocess
import sys


def start_ranks(script: str, *argv: str, env: dict[str, str], world: int = 2) -> list[subprocess.Popen]:
    from deepspec.data.engines.server import free_port

    env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
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
