"""Mixed precision by policy: what `train.precision` means on a device, and the set-up that follows from it.

bf16 training = bf16 autocast for activations and GEMMs, fp32 master weights and optimizer state (FSDP2 gathers
bf16 parameters and reduces gradients in fp32: deepspec/train/parallel.py), fp32 reductions in the losses
(deepspec/drafts/losses.py), and the frozen target embedding / LM head held in bf16. On CUDA the fp32 matmuls
that remain (fp32 runs, fp32 islands under autocast) use TF32 tensor cores.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

Precision = Literal["bf16", "fp32"]


def resolve_precision(precision: str, device: torch.device) -> Precision:
    """`train.precision` on `device`: auto = bf16 on GPUs, fp32 on CPUs; bf16_if_native = bf16 also on CPUs that
    multiply bf16 in hardware (AVX512-BF16 / AMX; elsewhere bf16 is emulated and several times slower)."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if precision == "bf16_if_native":
        from deepspec.cpus import cpu_has_native_bf16

        return "bf16" if device.type == "cuda" or cpu_has_native_bf16() else "fp32"
    if precision not in ("bf16", "fp32"):
        from deepspec.errors import ConfigError

        raise ConfigError(f"train.precision={precision!r} is not one of auto, bf16_if_native, bf16, fp32.")
    return precision  # type: ignore[return-value]


def enable_tf32(device: torch.device) -> None:
    """TF32 tensor cores for fp32 matmuls and convolutions on CUDA (10-bit mantissa products, fp32 accumulation);
    nothing elsewhere, so CPU runs keep exact fp32."""
    if device.type != "cuda":
        return
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True


def setup_precision(model: nn.Module, precision: str, device: torch.device) -> torch.dtype:
    """Called once by the trainer after the draft is on its device: TF32 on CUDA, the frozen target tensors in the
    training dtype. Returns the training dtype (bf16 or fp32) for the parallel wrapper's parameter policy."""
    enable_tf32(device)
    dtype = torch.bfloat16 if resolve_precision(precision, device) == "bf16" else torch.float32
    hold = getattr(model, "hold_target_in", None)
    if hold is not None:
        hold(dtype)
    return dtype
