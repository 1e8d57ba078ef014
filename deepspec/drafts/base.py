"""The contract every draft algorithm implements, and the batch it trains on.

An algorithm is one module (eagle3.py, dflash.py, dspark.py) with one `DraftModel` subclass
registered under its name. The trainer, the evaluator, the cache and export only talk to this
interface, so adding an algorithm touches none of them.

Alignment conventions (pinned by golden tests):
  * `DraftBatch.taps[b, t]` are the target's tap features *at* position t (produced while
    reading token t); `final_hidden[b, t]` maps through the frozen LM head to the target's
    distribution over token t+1.
  * `Proposer.propose` receives every committed token and the target features of the
    positions the draft has not seen yet; see its docstring.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from deepspec.drafts.plan import StepPlan, sample_ranges, use_buckets

if TYPE_CHECKING:
    from deepspec.config.model import ModelConfig


@dataclass
class DraftBatch:
    """A right-padded training batch of cached (or online) target features.

    Packing (train.pack_tokens): one row may hold several samples back to back. Then
    `position_ids` [B, T] int64 restarts at 0 at each sample's first token (RoPE positions) and
    `segment_ids` [B, T] int64 numbers the samples of a row 0..n-1 (padding = -1). Drafts never let
    attention, label shifts, anchors or blocks cross a segment boundary, so a packed batch gives the
    same per-sample losses as the padded one. Both None = one sample per row starting at position 0.
    """

    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] bool: assistant tokens (the ones a draft should predict)
    attention_mask: torch.Tensor  # [B, T] bool: real (non-padding) tokens
    taps: torch.Tensor  # [B, T, n_taps, H_target] float: tap features in model.target_layer_ids order
    final_hidden: torch.Tensor  # [B, T, H_target] float: target's final normed hidden state
    position_ids: torch.Tensor | None = None  # [B, T] int64, packed rows only
    segment_ids: torch.Tensor | None = None  # [B, T] int64, packed rows only (-1 = padding)
    # fp8 caches: taps / final_hidden arrive as float8 with these per-row scales and are widened by
    # `to(device, dtype)` on the device (bytes cross the bus in the cache's dtype); None otherwise.
    taps_scale: torch.Tensor | None = None  # [B, T, n_taps, rows] float32
    final_scale: torch.Tensor | None = None  # [B, T] float32
    # host facts the step needs (sample ranges, anchors and their chunk plans), made by the loader on the CPU so that
    # the step never reads a device value back (deepspec/drafts/plan.py); None = the draft makes it itself
    plan: Any = None

    def positions(self) -> torch.Tensor:
        """RoPE positions [B, T]: the packed ones, else 0..T-1 per row."""
        if self.position_ids is not None:
            return self.position_ids
        b, t = self.input_ids.shape
        return torch.arange(t, device=self.input_ids.device).unsqueeze(0).expand(b, t)

    def same_segment(self, shift: int) -> torch.Tensor | None:
        """[B, T - shift] bool: token t + shift belongs to the same sample as token t (None when unpacked)."""
        if self.segment_ids is None:
            return None
        s = self.segment_ids
        return (s[:, shift:] == s[:, : s.shape[1] - shift]) & (s[:, shift:] >= 0)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "DraftBatch":
        """Move to `device` in the stored dtypes (non-blocking from pinned memory), then, with `dtype`, widen the
        features there (fp8 scales applied): conversion happens on the device, never on the host."""
        moved = {f.name: None if (v := getattr(self, f.name)) is None else v.to(device=device, non_blocking=True) for f in fields(self)}
        if dtype is None:
            return DraftBatch(**moved)
        moved["taps"] = dequantize(moved["taps"], moved.pop("taps_scale"), dtype)
        moved["final_hidden"] = dequantize(moved["final_hidden"], moved.pop("final_scale"), dtype)
        return DraftBatch(**moved)

    def pin_memory(self) -> "DraftBatch":
        """Page-locked copy of the host tensors (DataLoader's pin thread calls this); tensors already on an accelerator
        (online features computed there) stay where they are."""
        return DraftBatch(**{f.name: None if (v := getattr(self, f.name)) is None else v.pin_memory() if f.name == "plan" or v.device.type == "cpu" else v
                             for f in fields(self)})

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the batch holds, its plan's included (the stager marks them used on its stream)."""
        out = [v for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)]
        if self.plan is not None:
            out += [v for v in self.plan.tensors() if v is not None]
        return out

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Features in `dtype`: a cast, or for fp8 x * scale with one scale per row of H (x [..., rows * H],
    scale [..., rows] — concatenated multi-stream taps carry one scale per stream)."""
    if scale is None:
        return x.to(dtype)
    rows = scale.shape[-1] if scale.dim() == x.dim() else 1
    if scale.dim() < x.dim():
        scale = scale.unsqueeze(-1)
    # the product in fp32, rounded once into `dtype` (bf16 staging would otherwise round the scale and the product)
    y = x.float().unflatten(-1, (rows, x.shape[-1] // rows)) * scale.float().unsqueeze(-1)
    return y.flatten(-2).to(dtype)


# Metrics are (numerator, denominator) pairs so ranks reduce them token-weighted:
# value = all_reduce(num) / all_reduce(den). Names are the project's metric names
# (e.g. "alpha_tf@1" teacher-forced acceptance, "expected_tau"), never a bare "accept_rate".
# The reserved key "_loss_weight" = (w, 1): the weight this micro-batch's mean loss gets in the
# token-weighted global mean (EAGLE-3: supervised tokens; DFlash/DSpark: the sum of prediction weights).
LOSS_WEIGHT = "_loss_weight"
Metrics = dict[str, tuple[torch.Tensor, torch.Tensor]]


class Proposer(ABC):
    """Per-sequence decoding state of a draft (KV cache etc.), used by the evaluator."""

    @abstractmethod
    def reset(self) -> None:
        """Forget everything (new prompt)."""

    @abstractmethod
    def propose(
        self,
        input_ids: torch.Tensor,
        new_taps: torch.Tensor,
        start: int,
        num_tokens: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Propose up to `num_tokens` tokens after `input_ids`.

        input_ids: [L] every committed token (prompt + accepted + the last token the target
            sampled, which the target has not processed yet).
        new_taps: [L-1-start, n_taps, H_target] target tap features for positions start..L-2;
            the proposer has seen positions < start in earlier calls and must drop any state
            it holds for positions >= start (rejected drafts) before using these.
        Returns (tokens [k] int64 in *target* vocabulary ids, probs [k, V_target] float32 =
        the draft distribution each token was drawn from; one-hot at temperature 0), k <= num_tokens.
        """


class DraftModel(nn.Module, ABC):
    """A trainable draft. Frozen target embeddings / LM head are buffers, never parameters."""

    algorithm: ClassVar[str]
    # The trainer sets this False on training steps whose metrics nobody logs (train.log_every): a draft may
    # then skip work that only feeds metrics (EAGLE-3: the full-vocabulary target head). The loss must not change.
    train_metrics: bool = True

    @classmethod
    @abstractmethod
    def from_target_config(cls, target_config: Any, model_cfg: "ModelConfig") -> "DraftModel":
        """Build a randomly initialised draft sized from the target's HF config and the recipe."""

    @abstractmethod
    def load_target_weights(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Copy the target's embedding [V, H] and LM head [V, H] into frozen buffers."""

    def set_token_frequencies(self, counts: torch.Tensor) -> None:
        """Loss-masked token counts [V_target] from the training data (builds d2t/t2d where used)."""

    @abstractmethod
    def loss(self, batch: DraftBatch) -> tuple[torch.Tensor, Metrics]:
        """Training loss (scalar, mean over this rank's supervised tokens) and metrics. Reads `batch.plan` when the
        loader made one (the step then reads no device value back), else makes it with `plan_batch`."""

    def plan_batch(self, batch: DraftBatch, key: int | None = None, buckets: bool | None = None) -> StepPlan:
        """The host facts `loss` needs about `batch` (deepspec/drafts/plan.py): the loader calls this on the CPU batch
        with the micro-batch's seed as `key` (random choices inside the loss, e.g. anchors, come from it); buckets:
        bucketed attention shapes (default: on CUDA). Reads only the batch and the draft's settings, never its
        weights, so the loader thread may call it while the step runs. This default: the samples of each row."""
        ids = batch.input_ids
        return StepPlan(sample_ranges(batch.segment_ids, *ids.shape), use_buckets(ids.device) if buckets is None else buckets)

    @abstractmethod
    def proposer(self) -> Proposer:
        """A fresh decoding state for one sequence."""

    @abstractmethod
    def export_config(self) -> dict[str, Any]:
        """deepspec's own config.json for this draft (architecture + sizes + algorithm fields)."""

    # Checkpoint I/O lives in deepspec/drafts/checkpoint.py; export writers in deepspec/export/.


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers except the frozen target copies (re-loaded from the target)."""
    frozen = {name for name, _ in model.named_buffers() if name.split(".")[-1] in ("target_embed", "target_lm_head")}
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def default_checkpoint_files(directory: str | Path) -> tuple[Path, Path]:
    d = Path(directory)
    return d / "config.json", d / "model.safetensors"
