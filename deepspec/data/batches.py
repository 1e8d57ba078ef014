"""Which samples each worker trains on at each step: a pure function of (seed, step).

The global batch of step s is a slice of a per-epoch permutation (seeded by seed + epoch), so
the order does not depend on the number of workers: resuming on another worker count with the
same global batch trains on exactly the same samples. Each global batch is sorted by length
(`bucketing: length`); worker r takes every world-th sample of that order (r, r+world, ...) and cuts its
share into micro-batches of consecutive samples. Dealing the sorted batch out keeps the workers' token
counts equal at every accumulation step (they wait for each other at each gradient all-reduce: handing
one worker the short half and the other the long half cost 2 CPU workers ~20% of their throughput) while
padding inside a micro-batch stays small. The grouping into micro-batches therefore depends on the worker
count (the samples of a step and the token-weighted gradient do not); with micro_batch_size 1 it does not.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from deepspec.drafts.base import DraftBatch
from deepspec.errors import ConfigError
from deepspec.data.buffers import POOL


@functools.lru_cache(maxsize=4)
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's sample order (read-only): drawn once, not once per step (a streamed run's producers ask for
    several steps' batches many times a second; a 1M-sample randperm costs ~10 ms)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_samples, generator=g)


def total_steps(num_samples: int, global_batch: int, max_steps: int | None, epochs: float) -> int:
    """How many optimizer steps a run takes: `train.max_steps` when set, else `train.epochs` over the full global
    batches of an epoch (the incomplete last one dropped), at least one. The trainer and a streamed run's plan
    document (what its producers make) both count by this rule."""
    return max_steps or max(1, math.floor(epochs * (num_samples // max(global_batch, 1))))


@dataclass(frozen=True)
class BatchPlan:
    num_samples: int
    global_batch: int
    micro_batch: int
    world: int
    seed: int
    bucketing: str = "length"

    def __post_init__(self) -> None:
        per_step = self.world * self.micro_batch
        if self.global_batch % per_step:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch} is not divisible by workers x micro batch = "
                f"{self.world} x {self.micro_batch} = {per_step}; change global_batch_size, micro_batch_size or the worker count."
            )
        if self.num_samples < self.global_batch:
            raise ConfigError(
                f"The training cache has {self.num_samples} samples, fewer than train.global_batch_size="
                f"{self.global_batch}; lower the global batch or cache more data."
            )

    @property
    def accum_steps(self) -> int:
        return self.global_batch // (self.world * self.micro_batch)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch  # the incomplete last batch is dropped

    def total_steps(self, max_steps: int | None, epochs: float) -> int:
        return total_steps(self.num_samples, self.global_batch, max_steps, epochs)

    def global_indices(self, step: int) -> list[int]:
        epoch, within = divmod(step, self.steps_per_epoch)
        perm = _epoch_permutation(self.num_samples, self.seed, epoch)
        return perm[within * self.global_batch : (within + 1) * self.global_batch].tolist()

    def read_order(self, step: int, lengths: Sequence[int] | None) -> list[int]:
        """The global batch of `step` in the order the workers read it: worker r reads positions r, r + world, ...
        one after the other (so this is also the order in which a streamed run's producers make it)."""
        idx = self.global_indices(step)
        if self.bucketing == "length" and lengths is not None:
            idx = sorted(idx, key=lambda i: (lengths[i], i))
        return idx

    def micro_batches(self, step: int, rank: int, lengths: Sequence[int] | None) -> list[list[int]]:
        """This worker's accumulation micro-batches (lists of sample indices) for `step`."""
        mine = self.read_order(step, lengths)[rank :: self.world]
        return [mine[i : i + self.micro_batch] for i in range(0, len(mine), self.micro_batch)]


class Prefetcher:
    """Reads and collates upcoming micro-batches in a background thread, in order.

    `schedule` yields (step, micro index, sample indices) in training order; at most `depth`
    batches are loaded ahead, so memory stays bounded. depth 0 = load synchronously. One thread
    only: dataset readers (mmap LRU, online target) need not be thread-safe. `plan(batch, step, m)`,
    when given, adds the step's host facts to each collated batch in the same thread (deepspec/drafts/plan.py).
    """

    def __init__(self, dataset: Any, collate, schedule, depth: int, plan=None):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        self.dataset, self.collate, self.schedule, self.plan = dataset, collate, iter(schedule), plan
        self.depth = depth
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepspec-data") if depth else None
        self.queue: deque = deque()

    def _load(self, item: tuple[int, int, list[int]]) -> DraftBatch:
        step, m, indices = item
        batch = self.collate([self.dataset[i] for i in indices])
        return batch if self.plan is None else self.plan(batch, step, m)

    def _fill(self) -> None:
        while self.pool is not None and len(self.queue) < self.depth:
            item = next(self.schedule, None)
            if item is None:
                return
            self.queue.append((item, self.pool.submit(self._load, item)))

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, int, DraftBatch]:
        if self.pool is None:
            item = next(self.schedule)
            return item[0], item[1], self._load(item)
        self._fill()
        if not self.queue:
            raise StopIteration
        (step, m, _), fut = self.queue.popleft()
        batch = fut.result()
        self._fill()
        return step, m, batch

    def close(self) -> None:
        if self.pool is not None:
            for _, fut in self.queue:
                fut.cancel()
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


def _empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Uninitialised host memory for a batch tensor: page-locked when it will be copied to a GPU (torch's host
    allocator recycles those blocks), shared when collated in a DataLoader worker process (handing it to the
    trainer process copies nothing), else a recycled buffer (deepspec/data/buffers.py: fresh pages cost more
    than the copy)."""
    if pin:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    from torch.utils.data import get_worker_info

    if get_worker_info() is not None:
        numel = math.prod(shape)
        storage = torch.UntypedStorage._new_shared(max(1, numel) * dtype.itemsize)
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
    return POOL.empty(shape, dtype)


def collate_features(items: list[dict[str, Any]], pad_token_id: int = 0, pad_to_multiple_of: int = 1, pin: bool = False) -> DraftBatch:
    """Right-pad samples ({input_ids, loss_mask, taps, final_hidden}, optional fp8 scales) into a DraftBatch.

    Features keep their dtype (the cache's: bf16 / fp8 / fp32) and are copied once, straight into the batch
    tensor; only the padding is zero-filled. `pin` allocates page-locked memory for an async copy to the GPU."""
    T = max(int(it["input_ids"].shape[0]) for it in items)
    T = -(-T // pad_to_multiple_of) * pad_to_multiple_of
    B = len(items)
    first = items[0]
    keys = ["taps", "final_hidden"] + [k for k in ("taps_scale", "final_scale") if first.get(k) is not None]
    _check_rows(items, keys, [int(it["input_ids"].shape[0]) for it in items])
    out = {k: _empty((B, T, *first[k].shape[1:]), first[k].dtype, pin) for k in keys}
    ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    lm = torch.zeros(B, T, dtype=torch.bool)
    am = torch.zeros(B, T, dtype=torch.bool)
    for b, it in enumerate(items):
        n = int(it["input_ids"].shape[0])
        ids[b, :n] = torch.as_tensor(it["input_ids"])
        lm[b, :n] = torch.as_tensor(it["loss_mask"]).bool()
        am[b, :n] = True
        for k in keys:  # Tensor.copy_ releases the GIL: the trainer's thread keeps launching work meanwhile
            out[k][b, :n].copy_(it[k])
            if n < T:
                out[k][b, n:].zero_()
    if pin:
        ids, lm, am = ids.pin_memory(), lm.pin_memory(), am.pin_memory()
    return DraftBatch(input_ids=ids, loss_mask=lm, attention_mask=am, **out)


def supervise_all_tokens(collate):
    """train.loss_tokens=all: every real token is a training target, prompt tokens included.

    The labels are the target's own next-token distributions (cached final states), which are just
    as valid after a prompt token as after an answer token, so this adds the prompt positions (a
    third of the quickstart's tokens) as distillation signal at no extra target cost. Validation keeps
    the assistant-only mask: answers are what a draft is served on."""

    def wrapped(items: list[Any], **kwargs: Any) -> DraftBatch:
        batch = collate(items, **kwargs)
        every = batch.attention_mask.clone()
        return dataclasses.replace(batch, loss_mask=every.pin_memory() if kwargs.get("pin") else every)

    return wrapped


# Packing keeps padding under this share of the packed tensor, whatever the batch.
MAX_PACK_PADDING = 0.05


def pack_layout(lengths: Sequence[int], pack_tokens: int) -> list[list[int]]:
    """Which samples share each packed row (sample indices, in their original order within a row).

    Rows = ceil(total / pack_tokens), filled longest-first into the emptiest row (balanced rows, so the
    padding up to the longest row is small); while padding is >= 5% of the packed tensor, one row fewer
    (one row has none), so a row may grow past the budget rather than pad."""
    total = sum(lengths)
    if not lengths:
        return []
    rows_n = max(1, min(len(lengths), -(-total // max(1, pack_tokens))))
    while True:
        rows: list[list[int]] = [[] for _ in range(rows_n)]
        fill = [0] * rows_n
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            r = min(range(rows_n), key=lambda r: (fill[r], r))
            rows[r].append(i)
            fill[r] += lengths[i]
        width = max(fill)
        if rows_n == 1 or rows_n * width - total < MAX_PACK_PADDING * rows_n * width:
            return [sorted(r) for r in rows if r]
        rows_n -= 1


_FEATURES = ("taps", "final_hidden", "taps_scale", "final_scale")
_PACK_STREAMS: dict[torch.device, Any] = {}
_PACK_STREAMS_LOCK = threading.Lock()


def _pack_stream(device: torch.device):
    """The stream that packs features already on a GPU (online features), one per device, made on first use.

    Not the caller's current stream: in the loader thread that is the default stream, where the draft's step is
    queued, so packing there would wait behind the step (and the stager, which reads the packed tensors on its own
    stream, would not wait for it at all)."""
    with _PACK_STREAMS_LOCK:
        if device not in _PACK_STREAMS:
            _PACK_STREAMS[device] = torch.cuda.Stream(device)
        return _PACK_STREAMS[device]


def _pack(layout: list[list[int]], lengths: list[int], sources: dict[str, tuple[list[torch.Tensor], torch.dtype]],
          pin: bool) -> DraftBatch:
    """Copy each sample's rows (sources[name] = (one [n_i, ...] tensor per sample, dtype)) back to back into one new
    [rows, width, ...] tensor per name: host tensors in `_empty`'s memory (page-locked with `pin`, so nothing pins
    them again), tensors on a GPU on that GPU. Each byte is written once: the samples by one copy, only the row tails
    zero-filled (never the whole tensor first). position_ids restart at 0 per sample, segment_ids number a row's
    samples (-1 = padding).

    Device sources must be complete when handed in (online features: OnlineFeatures waits for its forward). Their
    copies run on `_pack_stream`, and the host waits for them before returning, so the packed batch is complete for
    whichever stream reads it next (the stager's: deepspec/train/staging.py), and the unpacked tensors the caller
    drops afterwards have no copy still reading them when the allocator hands their memory out again."""
    import contextlib

    width = max(sum(lengths[i] for i in row) for row in layout)
    rows_n = len(layout)
    out: dict[str, torch.Tensor] = {}
    streams = []
    for name, (per_sample, dtype) in sources.items():
        device = per_sample[0].device
        stream = _pack_stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            shape = (rows_n, width, *per_sample[0].shape[1:])
            if device.type != "cpu":
                dst = torch.empty(shape, dtype=dtype, device=device)
            elif name in _FEATURES:  # the bulk of the bytes: recycled / page-locked / shared memory
                dst = _empty(shape, dtype, pin)
            else:  # ids and masks: a few bytes per token, not worth a pooled buffer
                dst = torch.empty(shape, dtype=dtype, pin_memory=pin)
            for r, row in enumerate(layout):
                at = 0
                for i in row:
                    dst[r, at : at + lengths[i]].copy_(per_sample[i])
                    at += lengths[i]
                if at < width:
                    dst[r, at:].zero_()
        if stream is not None and stream not in streams:
            streams.append(stream)
        out[name] = dst
    pos = torch.zeros(rows_n, width, dtype=torch.long, pin_memory=pin)
    seg = torch.full((rows_n, width), -1, dtype=torch.long, pin_memory=pin)
    for r, row in enumerate(layout):
        at = 0
        for j, i in enumerate(row):
            pos[r, at : at + lengths[i]] = torch.arange(lengths[i])
            seg[r, at : at + lengths[i]] = j
            at += lengths[i]
    for stream in streams:
        stream.synchronize()
    return DraftBatch(**out, position_ids=pos, segment_ids=seg)



def pack_batch(batch: DraftBatch, pack_tokens: int, pin: bool = False) -> DraftBatch:
    """Repack a right-padded batch so rows hold several samples back to back (DraftBatch's packing contract:
    position_ids restart per sample, segment_ids number the samples of a row, -1 = padding).

    Features keep their dtype and device (online features stay on the target's GPU); `pin` puts the host tensors
    in page-locked memory directly. A row whose real tokens are not a prefix (a left-padded or holed batch) raises:
    packing keeps each row's first attention_mask.sum() tokens, so it would silently train on padding."""
    am = batch.attention_mask.cpu()
    lengths = [int(n) for n in am.sum(1).tolist()]
    ragged = [b for b, n in enumerate(lengths) if not bool(am[b, :n].all())]
    if ragged:
        from deepspec.errors import DataError

        raise DataError(f"pack_batch needs right-padded rows (real tokens first); rows {ragged[:5]} are not. "
                        "Collate with deepspec.data.batches.collate_features, which right-pads.")
    names = ["input_ids", "loss_mask", "attention_mask", "taps", "final_hidden"]
    names += [k for k in ("taps_scale", "final_scale") if getattr(batch, k) is not None]
    sources = {}
    for k in names:
        x = getattr(batch, k)
        sources[k] = ([x[i, :n] for i, n in enumerate(lengths)], x.dtype)
    return _pack(pack_layout(lengths, pack_tokens), lengths, sources, pin)


def pack_features(items: list[dict[str, Any]], pack_tokens: int, pin: bool = False) -> DraftBatch:
    """`pack_batch(collate_features(items), pack_tokens)`, bit for bit, copying each sample's features once:
    from the cache's mapped views straight into the packed rows (no padded batch in between, no zero-filled
    tensor, no pinning copy: `pin` allocates the packed tensors page-locked)."""
    if not items:
        from deepspec.errors import DataError

        raise DataError("pack_features got an empty list of samples.")
    lengths = [int(it["input_ids"].shape[0]) for it in items]
    first = items[0]
    keys = ["taps", "final_hidden"] + [k for k in ("taps_scale", "final_scale") if first.get(k) is not None]
    _check_rows(items, keys, lengths)
    sources: dict[str, tuple[list[torch.Tensor], torch.dtype]] = {
        "input_ids": ([torch.as_tensor(it["input_ids"]) for it in items], torch.long),
        "loss_mask": ([torch.as_tensor(it["loss_mask"]).bool() for it in items], torch.bool),
        "attention_mask": ([torch.ones(n, dtype=torch.bool) for n in lengths], torch.bool),
    }
    for k in keys:
        sources[k] = ([it[k] for it in items], first[k].dtype)
    return _pack(pack_layout(lengths, pack_tokens), lengths, sources, pin)


def _check_rows(items: list[dict[str, Any]], keys: list[str], lengths: list[int]) -> None:
    """Every per-token field of a sample has its token count of rows. Checked because a copy would not say so: a
    one-row tensor broadcasts over all of them."""
    from deepspec.errors import CacheError

    for b, (it, n) in enumerate(zip(items, lengths)):
        for k in ["loss_mask", *keys]:
            got = it.get(k)
            if got is None:
                raise CacheError(f"Sample {b} of the batch has no {k!r} while sample 0 has one: the batch mixes caches.")
            if int(got.shape[0]) != n:
                raise CacheError(f"Sample {b} of the batch has {int(got.shape[0])} rows of {k!r} for {n} tokens: "
                                 "its cache record is inconsistent; rebuild the cache (deepspec data cache CONFIG --verify names it).")


def _pin_by_default() -> bool:
    """Whether a packed batch is made page-locked when the caller does not say: yes in a process that already uses
    CUDA (the trainer on a GPU, which copies it to the device from page-locked memory), never in a DataLoader worker
    (whose tensors go to shared memory) or a CPU run (where pinning would start CUDA for nothing)."""
    from torch.utils.data import get_worker_info

    return get_worker_info() is None and torch.cuda.is_available() and torch.cuda.is_initialized()


def packing(collate, pack_tokens: int):
    """train.pack_tokens > 0: each collated micro-batch is repacked into rows of about pack_tokens tokens.

    The cache's collate (collate_features) is skipped: its samples are packed straight from the mapped cache, one
    copy. Any other collate (online features, a dataset's own) builds its padded batch, which is then packed once.
    `pin` (default: whether this process uses CUDA, `_pin_by_default`) makes the packed host tensors page-locked
    from the start, so the loader's pinning finds nothing left to copy."""
    if not pack_tokens:
        return collate

    def wrapped(items: list[Any], pin: bool | None = None) -> DraftBatch:
        pin = _pin_by_default() if pin is None else pin
        if collate is collate_features:
            return pack_features(items, pack_tokens, pin=pin)
        return pack_batch(collate(items), pack_tokens, pin=pin)

    return wrapped


def sample_lengths(dataset: Any) -> list[int] | None:
    """Per-sample token counts when the dataset knows them without loading features."""
    for name in ("lengths", "sample_lengths"):
        v = getattr(dataset, name, None)
        if v is not None:
            v = v() if callable(v) else v
            return [int(x) for x in v]
    return None


def collate_fn(dataset: Any):
    return getattr(dataset, "collate", None) or collate_features
