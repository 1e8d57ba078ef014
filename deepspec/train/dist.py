"""Process-group setup and rank-aware helpers.

Workers are started by torchrun (env:// rendezvous: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*),
or run alone (`deepspec train`), in which case a one-process group is created so FSDP2 and
the collectives below work unchanged. NCCL on GPU, gloo on CPU.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    owns_group: bool  # we created the process group and must destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistInfo:
    """Join the torchrun group (or make a one-process one) and pick this worker's device."""
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        n_gpus = torch.cuda.device_count()
        if local_rank >= n_gpus:
            from deepspec.errors import DeepSpecError

            raise DeepSpecError(
                f"This worker has LOCAL_RANK {local_rank} but only {n_gpus} GPU(s) are visible: start at most one worker per GPU "
                "on each node (scripts/train/train.sh does by default), or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on CPU workers."
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    owns = False
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend=backend, device_id=device if use_cuda else None)
        else:
            store = dist.HashStore()
            dist.init_process_group(backend=backend, store=store, rank=0, world_size=1)
        owns = True
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, owns)


def teardown(info: DistInfo) -> None:
    global _HOST
    _HOST = None
    if info.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def reduce_metrics(sums: dict[str, Any], device: torch.device) -> dict[str, float]:
    """Token-weighted reduction: value = sum over ranks of numerators / sum of denominators.

    `sums[k]` is (numerator, denominator) as numbers or a 2-element tensor. Every rank must pass
    the same keys (drafts report the same metrics on every batch). One collective for all keys.
    """
    if not sums:
        return {}
    keys = sorted(sums)
    t = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64).to(device).reshape(2) for k in keys])
    all_reduce_sum(t)
    t = t.cpu()
    return {k: (float(t[i, 0] / t[i, 1]) if float(t[i, 1]) > 0 else float("nan")) for i, k in enumerate(keys)}


# Ranks that wait while one of them does slow host work alone (rank 0 writing a checkpoint) wait on the host, over gloo,
# up to this long: NCCL's watchdog aborts a collective after its default 10 minutes, and a large checkpoint written to
# a slow shared filesystem can take longer (and would again at the next save after every resume). A rank that dies
# meanwhile is noticed at once: its peers' sockets close.
HOST_WAIT = datetime.timedelta(hours=2)
_HOST: tuple[Any, Any] | None = None  # (the default group it was made for, its gloo group)


def host_group() -> Any:
    """The gloo group, over every rank, in which ranks wait on the host (HOST_WAIT); made once per default group.
    Collective the first time: every rank must call it. None when not distributed."""
    global _HOST
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    world = dist.group.WORLD
    if _HOST is None or _HOST[0] is not world:
        _HOST = (world, dist.new_group(backend="gloo", timeout=HOST_WAIT))
    return _HOST[1]


def host_barrier() -> None:
    """Every rank waits for the others on the host (host_group)."""
    group = host_group()
    if group is not None:
        dist.barrier(group=group)
