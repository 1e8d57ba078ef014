"""Feeding the trainer: the plan's micro-batches read and collated ahead, in order, in threads or worker processes.

The order of micro-batches is the BatchPlan's (a pure function of seed and step), so resuming stays exact
whichever loader runs. Two loaders behind one iterator of (step, micro index, batch):

* `Prefetcher` (deepspec/data/batches.py): one background thread, `depth` batches ahead, the default. A sample
  is read as zero-copy views of the mapped cache and copied once into the batch — page-locked on CUDA (torch's
  host allocator recycles those blocks), a recycled buffer elsewhere — by torch copies that release the GIL.
  Datasets that cannot leave this process (online features from a target held here) always use it.
* `ProcessLoader` (`train.loader_processes` > 0): DataLoader worker processes collating into shared memory,
  pinned in the trainer process on CUDA, for datasets whose per-sample work is Python-bound.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable, Iterable, Iterator

import torch

from deepspec.drafts.base import DraftBatch
from deepspec.data.batches import Prefetcher

Schedule = Iterable[tuple[int, int, list[int]]]
# (batch, step, micro index) -> the batch with its step plan (deepspec/drafts/plan.py)
Planner = Callable[[DraftBatch, int, int], DraftBatch]


def resolve_depth(requested: int | None, device: torch.device, dataset: Any) -> int:
    """Micro-batches the background thread loads ahead: `requested` when set, else 2 where loading overlaps
    something — a GPU, which computes while the host reads and copies, or a streamed spool, whose records may still
    be on their way from a producer — and 0 (inline) otherwise. On a CPU reading a cache, or running a co-located
    target, the thread has nothing to overlap: it takes cores and the GIL from the training step itself (the
    quickstart's training on 2 cores: 293 tokens/s inline, 256-264 with the thread; docs/benchmarks.md)."""
    if requested is not None:
        return requested
    return 2 if device.type == "cuda" or getattr(dataset, "follow", None) is not None else 0


def resolve_processes(requested: int | None, device: torch.device, local_world: int, dataset: Any) -> int:
    """Loader processes for one rank: `requested` when set (>= 0), else none.

    For the cache, the thread is the faster loader (benchmarks/bench_loader.py, Qwen3-8B shape, 4k tokens, 2-core
    CPU: one thread ~10 GB/s into recycled buffers, two worker processes ~1.6 GB/s): a sample costs one copy
    that releases the GIL, while a worker must fill fresh shared memory for every batch. Processes pay off for
    datasets whose per-sample work is Python-bound; `local_world` and `device` are kept for such policies."""
    if not getattr(dataset, "supports_worker_processes", False):
        return 0
    return requested if requested is not None and requested >= 0 else 0


class _PlanSampler:
    """DataLoader batch sampler over the plan: yields each micro-batch's sample indices and remembers its
    (step, micro index), which the loader pairs with the batch that comes back (DataLoader keeps order)."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.labels: deque[tuple[int, int]] = deque()

    def __iter__(self) -> Iterator[list[int]]:
        for step, m, indices in self.schedule:
            self.labels.append((step, m))
            yield list(indices)


def _worker_init(_: int) -> None:
    # each worker copies one batch at a time; parallelism comes from the number of workers
    torch.set_num_threads(1)


class ProcessLoader:
    """Iterates (step, micro index, batch) from `processes` DataLoader workers, `depth` batches in flight."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], DraftBatch], schedule: Schedule, *,
                 processes: int, depth: int, pin: bool, plan: Planner | None = None):
        from torch.utils.data import DataLoader

        self.plan = plan
        self.sampler = _PlanSampler(schedule)
        self.loader = DataLoader(
            dataset, batch_sampler=self.sampler, collate_fn=collate, num_workers=processes, pin_memory=pin,
            prefetch_factor=max(1, math.ceil(max(depth, processes) / processes)), worker_init_fn=_worker_init,
        )
        self._it = iter(self.loader)

    def __iter__(self) -> "ProcessLoader":
        return self

    def __next__(self) -> tuple[int, int, DraftBatch]:
        batch = next(self._it)
        step, m = self.sampler.labels.popleft()
        if self.plan is not None:  # made here, in the trainer process: the workers do not hold the draft
            batch = self.plan(batch, step, m)
        return step, m, batch

    def close(self) -> None:
        it, self._it = self._it, iter(())
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def build_loader(dataset: Any, collate: Callable[..., DraftBatch], schedule: Schedule, *, depth: int,
                 processes: int, pin: bool, packed: bool = False, plan: Planner | None = None) -> Prefetcher | ProcessLoader:
    """The loader for one rank. `collate(items, pin=...)` builds a batch; with `pin` (a CUDA device) it is
    page-locked once — by the collate itself in a thread, by DataLoader's pin thread after worker processes.
    A dataset that needs to know what is read when (the spool of a streamed run) sees the schedule first.
    `plan(batch, step, m)` adds each batch's step plan on the host, ahead of the step (deepspec/drafts/plan.py)."""
    follow = getattr(dataset, "follow", None)
    if follow is not None:
        schedule = follow(schedule)
    if pin and plan is not None:
        plan = _pinned_plan(plan)
    if processes > 0:
        return ProcessLoader(dataset, collate, schedule, processes=processes, depth=depth, pin=pin, plan=plan)
    if pin:
        collate = _pinned(collate, packed)
    return Prefetcher(dataset, collate, schedule, depth, plan)


def step_planner(model: Any, seed_of: Callable[[int, int], int], buckets: bool, kernel: str = "sdpa") -> Planner | None:
    """The loader's planner for `model` (None when the draft makes no plans): each micro-batch gets its step plan from
    the CPU batch, keyed by `seed_of(step, m)` — the micro-batch's seed, so its random choices (anchors) are the same on
    any worker count and after a resume, and never touch torch's generator from the loader thread. kernel: the block
    drafts' attention kernel, resolved (deepspec/drafts/plan.py resolve_kernel): "sdpa" or "flex"."""
    if kernel not in ("sdpa", "flex"):
        raise ValueError(f"step_planner takes a resolved kernel (sdpa or flex), got {kernel!r}")
    make = getattr(model, "plan_batch", None)
    if make is None:
        return None

    def plan(batch: DraftBatch, step: int, m: int) -> DraftBatch:
        batch.plan = make(batch, key=seed_of(step, m), buckets=buckets)
        batch.plan.kernel = kernel
        return batch

    return plan


def _pinned_plan(plan: Planner) -> Planner:
    def wrapped(batch: DraftBatch, step: int, m: int) -> DraftBatch:
        batch = plan(batch, step, m)
        if batch.plan is not None:
            batch.plan = batch.plan.pin_memory()
        return batch

    return wrapped


def _pinned(collate: Callable[..., DraftBatch], packed: bool) -> Callable[[list[Any]], DraftBatch]:
    """Collate into page-locked memory directly when the collate can (one copy); a packed batch is rebuilt
    after collation, and a dataset's own collate may not take `pin`: then pin its result."""
    import inspect

    params = inspect.signature(collate).parameters
    if not packed and ("pin" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())):
        return lambda items: collate(items, pin=True)
    return lambda items: collate(items).pin_memory()
