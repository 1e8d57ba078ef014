"""Muon's Newton–Schulz split across data-parallel ranks (`train.muon_shard`).

Under DDP every rank holds the same averaged gradients and the same momentum, so every rank computing every matrix's
orthogonalised update repeats the same work world times. On one H200 the Qwen3-8B DFlash draft's Muon step took 173 ms
(`benchmarks/results/2026-11-27-h200-c575b72/`), about a fifth of a step of 8 micro-batches — on 8 GPUs each rank
would repeat those 173 ms while its share of the forward and backward shrinks. Here each matrix has one owner rank;
owners orthogonalise their matrices and broadcast the results, and every rank applies every update. The update is the
same tensor on every rank as without sharding (the owner's is the one every rank would have computed: same inputs,
same kernels), so training, checkpoints and their optimizer state are unchanged — every rank still keeps every
momentum buffer, which keeps a checkpoint rank-independent and resumable on another worker count.

Owners are chosen by Newton–Schulz cost (a rows x cols matrix with rows <= cols costs ~ rows^2 * cols per
iteration), largest first onto the least-loaded rank: the same deterministic plan on every rank, from shapes alone.
Not under FSDP, whose parameters are sharded tensors: there each rank already holds a slice.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor


def ns_cost(shape: torch.Size) -> int:
    """Newton–Schulz work of one matrix, up to a constant: its Gram matrix is min^2 x max."""
    small, large = sorted(shape[:2])
    return small * small * large


def assign_owners(shapes: list[torch.Size], world: int) -> list[int]:
    """One owner rank per matrix: largest cost first onto the least-loaded rank (ties: lower rank, earlier matrix)."""
    load = [0] * world
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_cost(shapes[i]), i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += ns_cost(shapes[i])
    return owners


def shard_group_for(params: list[Tensor]) -> tuple[int, int] | None:
    """(rank, world) when sharding applies: torch.distributed initialised with more than one rank and plain (not
    FSDP-sharded) parameters; None otherwise."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        DTensor = ()  # type: ignore[assignment]
    if any(isinstance(p, DTensor) for p in params):
        return None
    return dist.get_rank(), dist.get_world_size()


class Broadcasts:
    """Owners' results broadcast to every rank in the order they are added (the same order on every rank), applied
    once received. Buckets of `bucket_bytes` bound the memory held by results in flight: a rank waits for a bucket's
    broadcasts and applies them before it issues more, while the owners' next Newton–Schulz runs behind them."""

    def __init__(self, rank: int, apply: Callable[[Tensor, Tensor], None], bucket_bytes: int = 256 * 2**20):
        self.rank = rank
        self.apply = apply
        self.bucket_bytes = bucket_bytes
        self._pending: list[tuple[Tensor, Tensor, object]] = []
        self._bytes = 0

    def add(self, param: Tensor, owner: int, result: Tensor | None, dtype: torch.dtype) -> None:
        """result: this rank's orthogonalised update when it owns `param`, else None (a buffer receives it)."""
        if owner == self.rank:
            buf = result.contiguous()
        else:
            buf = torch.empty(param.shape, dtype=dtype, device=param.device)
        work = dist.broadcast(buf, src=owner, async_op=True)
        self._pending.append((param, buf, work))
        self._bytes += buf.numel() * buf.element_size()
        if self._bytes >= self.bucket_bytes:
            self.flush()

    def flush(self) -> None:
        for param, buf, work in self._pending:
            work.wait()
            self.apply(param, buf)
        self._pending, self._bytes = [], 0
