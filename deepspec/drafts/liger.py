"""Liger-Kernel's fused linear KL divergence on CUDA, behind `soft_ce` (deepspec/drafts/losses.py).

Liger (`liger-kernel`, GPU machines only) fuses the draft LM head with the loss as `soft_ce`'s eager path does —
row chunks, gradients computed in the forward — but does the softmax, the loss and the logits' gradient in one
Triton pass over each chunk's logits instead of a dozen fp32 tensor passes. Its fused linear KL takes the target
distribution as a tensor, so EAGLE-3's teacher stays computed once per micro-batch (`teacher_logits`); its fused
linear JSD would multiply the teacher's head again at every TTT step, so it is not used.

Contract relied on (liger-kernel 0.8.5, `LigerFusedLinearKLDivFunction`, reduction "sum", no labels): it returns
sum_r sum_v q_rv (log max(q_rv, eps) - log softmax(x_r W^T)_v), and its gradient with respect to the logits is
softmax(x_r W^T) * sum_v q_rv - q_r. A target row scaled by w_r therefore gives w_r times the CE gradient, and a zero
row contributes nothing — per-row weights without a host sync. `soft_ce` turns the value back into
sum_r w_r CE_r (adds sum_r w_r H(p_r) - w_r log w_r). The eager path is the reference (tests/test_precision.py checks
this wrapper against an eager stand-in of the same contract; the kernel itself runs only on CUDA).

`import deepspec` never needs it: the import is guarded, and DEEPSPEC_LIGER=0 turns it off (A/B runs).
"""

from __future__ import annotations

import os
from typing import Callable

import torch

try:  # Triton kernels: a CUDA build of torch with triton; absent on CPU machines
    from liger_kernel.ops import LigerFusedLinearKLDivFunction as _LigerKL
except Exception:  # noqa: BLE001 - ImportError, or triton failing to initialise without a GPU
    _LigerKL = None

# The fused linear KL in use: (h [N, H], head [V, H], target [N, V]) -> sum_r KL(target_r || softmax(h_r head^T)),
# gradients for h and head. A module attribute so tests can stand in for the CUDA kernel.
fused_linear_kl: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
if _LigerKL is not None:

    def fused_linear_kl(h: torch.Tensor, head: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # noqa: F811
        # (h, head, target, shift_labels, reduction, ignore_index, temperature, eps, accum_dtype): fp32 weight gradient
        return _LigerKL.apply(h, head, target, None, "sum", -100, 1.0, 1e-30, torch.float32)


def available(x: torch.Tensor) -> bool:
    """True where `soft_ce` hands its loss to Liger: the kernel is importable, x is on CUDA, not turned off."""
    return fused_linear_kl is not None and x.is_cuda and os.environ.get("DEEPSPEC_LIGER", "1") != "0"
