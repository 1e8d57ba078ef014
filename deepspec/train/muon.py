"""Muon (momentum + Newton–Schulz orthogonalised updates) with the iteration's dtype chosen per machine.

Same update rule, defaults and state layout as `torch.optim.Muon` (Nesterov momentum, the quintic
Newton–Schulz coefficients, `adjust_lr_fn`), so the recipes tuned with it train the same. The one
difference: torch always iterates in bf16, which a CPU without AVX512-BF16 / AMX emulates — on a
2-core AVX2 EPYC one quickstart step took 22 s, nearly all of it in Newton–Schulz. Here the iteration
runs in bf16 where the hardware computes it (GPU, CPUs with native bf16) and in fp32 elsewhere. With
`shard=True` under DDP the Newton–Schulz work is split across the ranks (deepspec/train/muon_shard.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepspec.train.muon_shard import Broadcasts, assign_owners, shard_group_for

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic iteration of Keller Jordan's Muon
NS_STEPS = 5
EPS = 1e-7


def default_ns_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on GPU and on CPUs with native bf16, fp32 on other CPUs."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    from deepspec.cpus import cpu_has_native_bf16

    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def orthogonalize(update: Tensor, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS, eps: float = EPS,
                  dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximately U V^T of the update's SVD (all singular values pushed towards 1), by Newton–Schulz."""
    a, b, c = coefficients
    x = update.to(dtype)
    wide = x.size(0) <= x.size(1)
    if not wide:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x if wide else x.T


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """`match_rms_adamw` scales the orthogonal update to AdamW's typical RMS, so one lr serves both."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * max(rows, cols) ** 0.5
    if adjust_lr_fn in (None, "original"):
        return lr * max(1.0, rows / cols) ** 0.5
    return lr


class Muon(torch.optim.Optimizer):
    """Muon for 2-D weight matrices. `ns_dtype=None` picks the Newton–Schulz dtype for the params' device."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = EPS, ns_steps: int = NS_STEPS,
                 adjust_lr_fn: str | None = None, ns_dtype: torch.dtype | None = None, shard: bool = False):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"Muon needs lr, momentum and weight_decay >= 0, got {lr}, {momentum}, {weight_decay}.")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon only takes 2-D weight matrices; got a parameter of shape {tuple(p.shape)}.")
        # a property of the machine, not of the run: kept out of param_groups so a resumed optimizer
        # state from another machine does not carry it over
        self.ns_dtype = ns_dtype
        # split the Newton–Schulz work across data-parallel ranks (deepspec/train/muon_shard.py); same updates
        self.shard = shard

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr, momentum = float(group["lr"]), group["momentum"]
            dtype = self.ns_dtype or default_ns_dtype(params[0].device)

            def orthogonal(p: Tensor) -> Tensor:
                buf = self.state[p]["momentum_buffer"]
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                return orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)

            def apply(p: Tensor, update: Tensor) -> None:
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))

            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                state["momentum_buffer"].lerp_(p.grad, 1 - momentum)
            shard = shard_group_for(params) if self.shard else None
            if shard is None:
                for p in params:
                    apply(p, orthogonal(p))
                continue
            rank, world = shard
            owners = assign_owners([p.shape for p in params], world)
            sends = Broadcasts(rank, apply)
            for p, owner in zip(params, owners):
                sends.add(p, owner, orthogonal(p) if owner == rank else None, dtype)
            sends.flush()
        return loss
