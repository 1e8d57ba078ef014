"""What a training step needs to know about its batch on the host, made by the loader before the step runs.

A GPU runs ahead of the Python that feeds it only while nothing in the step reads a device value back: one read
(`.tolist()`, `.item()`, `int(t)`) drains the queue, and the GPU then idles while the host plans the next kernels.
The attention calls of a draft need host facts about the batch — where each packed sample starts and ends (EAGLE-3's
causal calls), where the block drafts' anchors are (which context keys each chunk of blocks reads) — so these are
computed here, on the CPU copy of the batch, by the loader thread, and travel with the batch as a `StepPlan`
(`DraftBatch.plan`). The draft reads its plan instead of its tensors; a batch without one (validation, evaluation,
tests calling `loss` directly) gets its plan made on the spot from its own tensors, with that one read.

Bucketed shapes: on CUDA the attention calls take their lengths from a short ladder (`bucket`) instead of the
data's exact lengths, so the kernels, their launch configurations and compiled regions see a few shapes per run
rather than a new one per batch. The extra keys are padding that the masks hide: results are the exact ones.
"""

from __future__ import annotations

from typing import Any

import torch

# (row, start, end): one contiguous sample of a batch row; row None = every row (unpacked layout)
Range = tuple[int | None, int, int]

# the shortest bucketed length; shorter calls are padded up to it
MIN_BUCKET = 64


def bucket(n: int) -> int:
    """The smallest length >= n on the ladder 64, 96, 128, 192, 256, 384, ... (2^k and 1.5 * 2^k): at most two shapes
    per doubling of the length, at most a third of a call's keys padding."""
    if n <= MIN_BUCKET:
        return MIN_BUCKET
    p = 1 << (n - 1).bit_length()  # the power of two >= n
    return p * 3 // 4 if n <= p * 3 // 4 else p


def use_buckets(device: torch.device | str) -> bool:
    """Bucketed attention shapes where shapes cost host time or compiled kernels (CUDA); exact ranges on a CPU, where
    padded keys only cost compute."""
    return torch.device(device).type == "cuda"


def resolve_kernel(setting: str, device: torch.device | str, packed: bool) -> str:
    """The block drafts' attention kernel for `train.attention` on `device`. `auto` takes FlexAttention where it was
    measured faster: on CUDA with packed rows (one H200, Qwen3-8B shape, the recipes' 16 x 4 samples packed in
    8,192-token rows: DFlash 49.8k tokens/s against 37.2k with chunked SDPA, benchmarks/results/2026-11-28-h200-8f1fde3).
    Packed rows are all near pack_tokens long, so their context lengths fall in one or two buckets, each compiled once.
    Unpacked samples of varying length would compile a kernel for each of many buckets, not yet measured: they, and the
    CPU (no FlexAttention backward there), keep the chunked SDPA calls."""
    if setting != "auto":
        return setting
    return "flex" if packed and torch.device(device).type == "cuda" else "sdpa"


def sample_ranges(segment_ids: torch.Tensor | None, batch: int, length: int) -> list[Range]:
    """Contiguous samples of each row from `segment_ids` [B, T] (-1 = padding, skipped); None = one per row.

    Reads the ids on the host: made by the loader from the CPU batch (`plan_for`), inside a step only when a batch
    arrives without a plan."""
    if segment_ids is None:
        return [(None, 0, length)]
    seg = segment_ids.detach().cpu()
    out: list[Range] = []
    for b in range(batch):
        row = seg[b]
        cuts = ((row[1:] != row[:-1]).nonzero().squeeze(1) + 1).tolist()
        for s, e in zip([0] + cuts, cuts + [length]):
            if int(row[s]) >= 0:
                out.append((b, s, e))
    return out


class StepPlan:
    """Host facts about one batch (see the module docstring). Not a dataclass on purpose: DDP's input mover walks
    dataclasses and would rebuild this one; its tensors move with `to`.

    ranges: the batch's samples (row, start, end); buckets: whether attention calls pad to `bucket` lengths; kernel:
    the block drafts' attention (train.attention);
    anchors / keep / ctx_start [B, A] (block drafts): the drawn anchors, as tensors for the device and `bounds`
    (deepspec.drafts.attention.BlockBounds) as their host copies with the chunk plans made from them."""

    __slots__ = ("ranges", "buckets", "anchors", "keep", "ctx_start", "bounds", "kernel")

    def __init__(self, ranges: list[Range], buckets: bool, anchors: torch.Tensor | None = None, keep: torch.Tensor | None = None,
                 ctx_start: torch.Tensor | None = None, bounds: Any = None, kernel: str = "sdpa"):
        self.ranges, self.buckets = ranges, buckets
        self.anchors, self.keep, self.ctx_start, self.bounds = anchors, keep, ctx_start, bounds
        self.kernel = kernel  # the block drafts' attention: "sdpa" (chunked calls) or "flex" (one FlexAttention call)

    def _tensors(self) -> dict[str, torch.Tensor | None]:
        return {"anchors": self.anchors, "keep": self.keep, "ctx_start": self.ctx_start}

    def tensors(self) -> list[torch.Tensor | None]:
        return list(self._tensors().values())

    def to(self, device: torch.device | str, non_blocking: bool = True) -> StepPlan:
        moved = {k: None if v is None else v.to(device=device, non_blocking=non_blocking) for k, v in self._tensors().items()}
        return StepPlan(self.ranges, self.buckets, bounds=self.bounds, kernel=self.kernel, **moved)

    def pin_memory(self) -> StepPlan:
        pinned = {k: None if v is None or v.device.type != "cpu" else v.pin_memory() for k, v in self._tensors().items()}
        return StepPlan(self.ranges, self.buckets, bounds=self.bounds, kernel=self.kernel, **pinned)

