"""Liger-Kernel's fused linear KL divergence on CUDA, behind `soft_ce` (deepspec/drafts/losses.py).

Liger (`liger-kernel`, GPU machines only) fuses the draft LM head with the loss as `soft_ce`'s eager path does —
row chunks, gradients computed in the forward — but does the softmax, the loss and the logits' gradient in one
Triton pass over each chunk's logits instead of a dozen fp32 tensor passes. Its fused linear KL takes the target
distribution as a tensor, so EAGLE-3's teacher stays computed once per micro-batch (`teacher_logits`); its fused
linear JSD would multiply the teacher's head again at every TTT step, so it is not used.

Contract relied on (liger-kernel 0.8.5, `fused_linear_kl_div_forward`, reduction "sum", no labels): it returns
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
    from liger_kernel.ops.fused_linear_kl_div import fused_linear_kl_div_forward as _liger_forward
except Exception:  # noqa: BLE001 - ImportError, or triton failing to initialise without a GPU
    _liger_forward = None


def _contract_forward(h, head, target, shift_labels, reduction, ignore_index, has_label, temperature, eps, accum_dtype):
    """Liger's `fused_linear_kl_div_forward`, as 0.8.5 (constraints.txt) calls it: (loss, dL/dh, dL/dhead), the
    gradients computed in the forward. A module attribute so tests can stand in an eager version on a CPU."""
    return _liger_forward(h, head, target, shift_labels, reduction, ignore_index, has_label, temperature, eps, accum_dtype)


class FusedLinearKL(torch.autograd.Function):
    """Liger's fused forward with a backward that reads nothing on the host. Liger's own Function asks
    `grad_output != 1` as a Python bool in its backward (after building the 1.0 on the device from the host): two
    host syncs per call — 112 of EAGLE-3's 116 per optimizer step on an H200 (8 micro-batches x 7 TTT steps), its
    backward holding the host for 0.5 s of a 1.35 s step (benchmarks/results/2026-11-28-h200-8f1fde3). Here the
    saved gradients are scaled on the device whatever grad_output is (a multiply by 1.0 costs less than a drain)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, h: torch.Tensor, head: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # reduction "sum", no labels, temperature 1, eps far below any target entry, fp32 weight-gradient accumulator
        loss, grad_h, grad_head = _contract_forward(h, head, target.contiguous(), None, "sum", -100, False, 1.0, 1e-30,
                                                    torch.float32)
        ctx.save_for_backward(grad_h.detach(), grad_head.detach() if grad_head is not None else None)
        return loss

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_output: torch.Tensor):
        grad_h, grad_head = ctx.saved_tensors  # scaled out of place: a second backward (retain_graph) stays right
        if grad_head is not None:
            grad_head = grad_head * grad_output.to(grad_head.dtype)
        return grad_h * grad_output.to(grad_h.dtype), grad_head, None


# The fused linear KL in use: (h [N, H], head [V, H], target [N, V]) -> sum_r KL(target_r || softmax(h_r head^T)),
# gradients for h and head. A module attribute so tests can stand in for the CUDA kernel.
fused_linear_kl: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
if _liger_forward is not None:
    fused_linear_kl = FusedLinearKL.apply


def available(x: torch.Tensor) -> bool:
    """True where `soft_ce` hands its loss to Liger: the kernel is importable, x is on CUDA, not turned off."""
    return fused_linear_kl is not None and x.is_cuda and os.environ.get("DEEPSPEC_LIGER", "1") != "0"
