"""Moving the next micro-batch to the accelerator while the current one trains.

The loader (deepspec/train/loader.py) reads and collates ahead on the host; on CUDA its batches are
page-locked, so the copy to the GPU is a DMA that runs on a side stream, one batch ahead, overlapping the
current micro-batch's compute. Features cross in the cache's dtype (bf16 / fp8) and are converted to the
training dtype on the device (`DraftBatch.to`): bf16 when training in bf16 (`feature_dtype`), so a bf16 cache's
features are used as they arrive and an fp8 cache's are widened once, to bf16 — not to fp32 first, which doubled
their memory and made autocast / FSDP2's bf16 parameters round them back. The training stream waits for that copy
with an event (no host sync) and the staged tensors are marked as used on it, so the allocator does not hand their
memory back to the side stream early (pinned host blocks are likewise kept until their copy is done by torch's
host allocator). On a CPU a batch is only cast, as before.

A batch whose tensors are already on the GPU (cache.mode=online: the target's features, packed there too) must be
complete when the loader hands it over: the stager reads it on its own stream without waiting for the stream that
made it. OnlineFeatures and pack_batch (deepspec/data/batches.py) wait for their own work before returning.

The supervised-token and real-token counts are read on the host from the CPU copy, before any
transfer, so the loop needs no device-to-host sync per micro-batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch


def feature_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype features are staged in for `train.precision` on `device`: the training dtype (bf16 where
    deepspec/train/precision.py resolves the precision to bf16, on GPUs and on CPUs with native bf16 when asked;
    fp32 otherwise, where CPU results stay exactly as they were)."""
    from deepspec.train.precision import resolve_precision

    return torch.bfloat16 if resolve_precision(precision, device) == "bf16" else torch.float32


def _tensors(batch: Any) -> list[torch.Tensor]:
    own = getattr(batch, "tensors", None)  # a batch that carries more than its fields' tensors lists them itself
    if callable(own):
        return list(own())
    return [v for f in dataclasses.fields(batch) if isinstance(v := getattr(batch, f.name), torch.Tensor)]


class DeviceStager:
    """Iterates (step, micro index, batch on device, supervised tokens, real tokens), one batch staged ahead.

    `dtype` is the dtype the model trains in (the one `setup_precision` returns, or `feature_dtype`): features
    are converted to it on the device. It has no default, so no caller stages bf16 training's features in fp32."""

    def __init__(self, source: Iterator[tuple[int, int, Any]], device: torch.device, dtype: torch.dtype):
        self.source, self.device, self.dtype = source, device, dtype
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._next: tuple | None = None
        self._started = False

    def _stage(self) -> None:
        item = next(self.source, None)
        if item is None:
            self._next = None
            return
        step, m, batch = item
        n_tok, n_real = batch.num_loss_tokens, int(batch.attention_mask.sum())  # host tensors: no device sync
        if self.stream is None:
            self._next = (step, m, batch.to(self.device, self.dtype), n_tok, n_real, None)
            return
        with torch.cuda.stream(self.stream):
            for t in _tensors(batch):
                if t.device.type == "cuda":  # online features, complete (see above), read by the conversion
                    t.record_stream(self.stream)  # below: their memory is not handed out again before it ran
            staged = batch.to(self.device, self.dtype)  # non_blocking from pinned memory: an async DMA
            done = torch.cuda.Event()
            done.record(self.stream)
        self._next = (step, m, staged, n_tok, n_real, done)

    def __iter__(self) -> "DeviceStager":
        return self

    def __next__(self) -> tuple[int, int, Any, int, int]:
        if not self._started:
            self._started = True
            self._stage()
        if self._next is None:
            raise StopIteration
        step, m, batch, n_tok, n_real, done = self._next
        if done is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(done)
            for t in _tensors(batch):
                t.record_stream(main)
        self._stage()  # the following batch's copy overlaps this one's compute
        return step, m, batch, n_tok, n_real
