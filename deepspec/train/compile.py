"""Regional `torch.compile` of the draft layers (`train.compile`).

What is compiled: every piece of a draft decoder layer except the attention call — the RMSNorms, the q/k/v
projections with their q/k norms and RoPE (`Attention.project_q` / `project_kv`), the output projection
(`Attention.output`) and the gated MLP — plus the drafts' other norms (EAGLE-3's hidden / fc norms, the final norm,
DFlash's context norm), the RoPE tables (`RotaryEmbedding`) and a block draft's loss terms per chunk of prediction
rows (`BlockDraft._chunk_terms`: the head GEMM, log-softmax, the target's softmax, CE / L1 / alpha / top-1) and
EAGLE-3's TTT attention around its causal calls (`ChainParts`: the diagonal — each row's own chain keys in fp32 —,
its backward, and the merges of a call's output with it). Inductor turns each region into a few fused kernels each way (a
norm: one; q + q_norm + RoPE: the GEMM and one), where eager PyTorch launches one kernel per elementwise op and per
slice of the memory-lean norm.

What is not: the attention calls and their plans. The chunk plans are Python ints that change with every batch
(anchors, sample ranges, TTT depth), so tracing through them either recompiles for each new plan or breaks the graph
around every chunk. The drafts call the layer pieces themselves (block.py `_layer`, eagle3.py `_layer`) and the
attention between them, so compiling the pieces, not the layer, leaves the calls eager by construction — no
`torch.compiler.disable` needed.

How: each region is a method of a layer module (`forward` of RMSNorm / MLP / RotaryEmbedding, the three Attention
methods). One `torch.compile` of the class's function is shared by every instance, and the instance gets an attribute
of the same name (a `CompiledRegion`) that shadows the class's method. So:

* every layer reuses the same compiled graphs (the module is an argument: Dynamo guards on its structure — sizes,
  eps, whether a q_norm exists — and passes its parameters in, so eight layers compile once, not eight times);
* module hooks (FSDP2's gather around the MLP unit) stay outside the compiled code, where they run eagerly;
* parameter names, `state_dict` and checkpoints are unchanged (the regions are not modules);
* `uncompile_draft` removes the attributes and the draft is eager again.

Shapes: the token dimensions (batch, sequence) of a region's inputs are marked dynamic before its first call, so the
first compilation is already shape-generic and batches of other lengths reuse it instead of recompiling per length;
only the feature dimension (and the head count) stays static, which is what the kernels specialise on. A region
compiles once per kind of input it meets — dtype, grad mode, whether the input requires grad, its memory layout, the
feature width (EAGLE-3's first layer reads 2H) — not per length: a training run compiles each region for training and
again for validation (no grad). Dimensions of size 1 are still specialised by Dynamo (a batch of one sample, then one
of two, compiles twice). Past torch's limit of graphs per function (`torch._dynamo.config.recompile_limit`: 8, or 128
once `train.attention=flex` has run on CUDA, deepspec/drafts/flex.py) a new
kind of input runs that region eagerly, with a warning from torch.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from deepspec.errors import ConfigError

log = logging.getLogger(__name__)

# Which dimensions of each tensor argument vary from batch to batch. LEADING: every dimension but the last (the
# features). A tuple: those dimensions only (Attention.output reads [B, heads, T, head_dim]; heads are fixed).
LEADING = "leading"
_DimSpec = str | tuple[int, ...]


def _regions() -> dict[type, dict[str, tuple[_DimSpec, ...]]]:
    from deepspec.drafts.attention import ChainParts
    from deepspec.drafts.block import BlockDraft
    from deepspec.drafts.layers import MLP, Attention, RMSNorm, RotaryEmbedding

    return {
        # a block draft's loss terms over one chunk of prediction rows: h, fh [rows, H], labels [rows], z [rows, r] ->
        # the head GEMM, softcap, log-softmax, the target's softmax and the L1 / alpha / top-1 reductions, which eager
        # runs as a dozen kernels each materialising a [rows, V] fp32 tensor
        BlockDraft: {"_chunk_terms": (LEADING, LEADING, (0,), LEADING)},
        # EAGLE-3's TTT attention around its causal calls: q / out / grad / lse [B, h, T, *], the chain keys
        # [B, hk, T, k, d] (k = the TTT step: one graph for step 1, one for the later steps, per grad mode)
        ChainParts: {"diagonal": ((0, 2), (0, 2, 3), (0, 2, 3)), "merge": ((0, 2), (0, 2)),
                     "diagonal_backward": ((0, 2), (0, 2, 3), (0, 2, 3), (0, 2), (0, 2), (0, 2)),
                     "merge_lse": ((0, 2), (0, 2), (0, 2), (0, 2))},
        RMSNorm: {"forward": (LEADING,)},
        MLP: {"forward": (LEADING,)},
        RotaryEmbedding: {"forward": ((0, 1), ())},  # position_ids [B, T] -> cos / sin; the dtype is not a tensor
        Attention: {
            "project_q": (LEADING, LEADING, LEADING),  # x [B, T, in], cos / sin [B, T, head_dim]
            "project_kv": (LEADING, LEADING, LEADING),
            "output": ((0, 2),),
        },
    }


# Inductor's options for the regions. emulate_precision_casts: round wherever eager rounds. Without it Inductor keeps
# a fused kernel's intermediates in fp32 across an explicit cast to bf16 and back, so a Llama/Qwen3-style RMSNorm
# (normalised in fp32, rounded to the input dtype, then scaled by the weight) came out one bf16 step off HF's and the
# engines' rounding in some elements. The extra roundings are arithmetic inside memory-bound kernels.
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


def keeps_bf16_round_trips() -> bool:
    """Whether this torch's Inductor honours `emulate_precision_casts` for a cast to bf16 and back. Before 2.13 its
    joint-graph pass `pointless_convert` removes every fp32 -> bf16 -> fp32 chain whatever the option says (read in
    torch 2.11 and 2.12), so a compiled Llama/Qwen3-style RMSNorm scales the unrounded normalised value: up to one bf16
    step from HF's and the engines' rounding, in about a quarter of the elements (measured under torch 2.11, CPU)."""
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return (major, minor) >= (2, 13)


# one torch.compile per class function: every instance shares it (and with it Dynamo's cache of graphs)
_COMPILED: dict[Callable, Callable] = {}


def _compiled(fn: Callable) -> Callable:
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=None, options=dict(INDUCTOR_OPTIONS))
    return _COMPILED[fn]


class CompiledRegion:
    """A module method replaced by its compiled function: set as an instance attribute, it shadows the class's method,
    so the drafts' own calls (`layer.self_attn.project_q(...)`, `module(x)` -> `forward`) reach it unchanged."""

    def __init__(self, owner: nn.Module, name: str, fn: Callable, compiled: Callable, dims: tuple[_DimSpec, ...]):
        self.owner = owner
        self.name = name
        self.fn = fn
        self.compiled = compiled
        self.dims = dims

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # traced from inside another compiled region (a q_norm inside project_q): inline the plain method
            return self.fn(self.owner, *args, **kwargs)
        for arg, spec in zip(args, self.dims):
            if isinstance(arg, torch.Tensor):
                for d in range(arg.dim() - 1) if spec == LEADING else spec:
                    # maybe_: a size-1 dimension may still be specialised without an error
                    torch._dynamo.maybe_mark_dynamic(arg, d)
        return self.compiled(self.owner, *args, **kwargs)

    def __repr__(self) -> str:
        return f"CompiledRegion({type(self.owner).__name__}.{self.name})"


def resolve_compile(setting: bool | str, device: torch.device | str | None) -> bool:
    """Whether `train.compile` compiles on `device`. `auto`: on CUDA when Triton (Inductor's GPU code generator) is
    present — where fused kernels pay for the compilation many times over; eager on the CPU, where a short test run
    would spend most of its time compiling and the fp32 CPU kernels gain little."""
    if setting is True or setting is False:
        return setting
    if setting != "auto":
        raise ConfigError(f"train.compile must be true, false or auto, got {setting!r}.")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda":
        return False
    from torch.utils._triton import has_triton

    if not has_triton():
        log.warning("train.compile=auto: Triton is not importable, so the draft layers run eagerly on %s.", dev)
        return False
    return True


def compile_draft(model: nn.Module, setting: bool | str = True, device: torch.device | str | None = None) -> bool:
    """Compile the layer regions of every draft layer under `model` in place (a draft, or a wrapper holding one: the
    wrapper's forward is not compiled) when `setting` (`train.compile`) asks for it on `device` (None: where the model's
    parameters are). Returns whether it did.

    Call it after the draft is on its device and wrapped (DDP / FSDP2): nothing is compiled until the first forward,
    and wrapping neither renames nor replaces the layer modules the regions live on. Calling it twice leaves the first
    regions in place.
    """
    if not resolve_compile(setting, device if device is not None else _device_of(model)):
        return False
    from deepspec.drafts.layers import Attention

    regions = _regions()
    # norms inside an Attention (q_norm, k_norm) are reached only from its compiled project_q / project_kv, which trace
    # them inline; a region of their own would be an object per layer that Dynamo guards by identity (a recompile per
    # layer of the enclosing region)
    inner = {id(m) for a in model.modules() if isinstance(a, Attention) for m in a.modules() if m is not a}
    count = 0
    for module in model.modules():
        if id(module) in inner:
            continue
        for cls, methods in regions.items():
            if not isinstance(module, cls):
                continue
            for name, dims in methods.items():
                if isinstance(module.__dict__.get(name), CompiledRegion):
                    continue
                fn = getattr(type(module), name)  # the module's own override, if its class has one
                module.__dict__[name] = CompiledRegion(module, name, fn, _compiled(fn), dims)
                count += 1
    log.info("compiled %d draft regions (norms, q/k/v/o projections with RoPE, MLPs, block drafts' loss chunks, "
             "EAGLE-3's chain parts); the attention calls stay eager", count)
    if not keeps_bf16_round_trips():
        log.warning("torch %s's Inductor drops the bf16 rounding of the RMSNorms' normalised value inside compiled "
                    "regions (HF and the serving engines round it): compiled norms differ from eager ones by up to one "
                    "bf16 step. Harmless for training; torch >= 2.13 rounds as eager does (train.compile=false also "
                    "does).", torch.__version__)
    return True


def uncompile_draft(model: nn.Module) -> None:
    """Remove the regions `compile_draft` installed: every layer runs its eager methods again."""
    for module in model.modules():
        for name in [k for k, v in module.__dict__.items() if isinstance(v, CompiledRegion)]:
            del module.__dict__[name]


def compiled_regions(model: nn.Module) -> list[CompiledRegion]:
    """The regions installed under `model` (for logging and tests)."""
    return [v for m in model.modules() for v in m.__dict__.values() if isinstance(v, CompiledRegion)]


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
