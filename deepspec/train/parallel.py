"""Wrapping the draft for data parallelism (DDP or FSDP2) behind one `forward(batch)`.

Drafts expose `loss(batch)`, not `forward`; DDP and FSDP2 only hook `forward`, so a thin module
routes forward -> loss. Frozen target embedding / LM head are buffers: DDP does not reduce them
and FSDP2 does not shard them (each worker keeps one copy, no optimizer state, in the training dtype:
deepspec/train/precision.py).

DDP is the default (`train.parallel: ddp`): a draft under ~1B parameters (every shipped recipe) keeps its fp32
weights, gradients and Adam state in a few GB per rank, and DDP's one all-reduce per step overlaps the backward.
FSDP2 (`train.parallel: fsdp`) shards weights, gradients and optimizer state for larger drafts: bf16 parameters
gathered, fp32 gradient reductions (MixedPrecisionPolicy) when training in bf16; every draft block its own unit;
each unit gathered once per optimizer step (kept across the TTT steps of a forward, its backward and the step's
micro-batches — `accumulating` / `release_gathered` below), so it costs about ZeRO-2 memory for the blocks and one all-gather per step.
"""

from __future__ import annotations

import torch
from torch import nn

from deepspec.drafts.base import DraftBatch

FROZEN_SUFFIXES = ("target_embed", "target_lm_head")


class LossModule(nn.Module):
    def __init__(self, draft: nn.Module):
        super().__init__()
        self.draft = draft

    def forward(self, batch: DraftBatch):
        return self.draft.loss(batch)


def wrap(draft: nn.Module, parallel: str, world: int, device: torch.device, param_dtype: torch.dtype = torch.float32) -> nn.Module:
    """`param_dtype`: the training dtype (deepspec/train/precision.py); bf16 makes FSDP2 gather bf16 parameters and
    reduce gradients in fp32 (DDP's weights stay fp32 and autocast casts them per GEMM)."""
    module = LossModule(draft)
    if parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype != torch.float32 else MixedPrecisionPolicy()
        # reshard_after_forward=False: EAGLE-3 calls its blocks once per TTT step and the backward needs them again,
        # so a unit stays gathered from its first use to the end of the backward (`accumulating` keeps it across
        # micro-batches)
        for unit in fsdp_units(draft):
            fully_shard(unit, mp_policy=mp, reshard_after_forward=False)
        fully_shard(module, mp_policy=mp, reshard_after_forward=False)
        return module
    if world > 1:
        import warnings

        from torch.nn.parallel import DistributedDataParallel as DDP

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers' rename; the old name keeps init semantics
            return DDP(
                module,
                device_ids=[device.index] if device.type == "cuda" else None,
                broadcast_buffers=False,  # buffers are the frozen target copies, identical everywhere
            )
    return module


def fsdp_units(draft: nn.Module) -> list[nn.Module]:
    """The submodules FSDP2 shards as units of their own (the root unit takes the rest): one per repeated block.

    FSDP2 gathers a unit's weights only around that unit's forward(). A `DecoderLayer` has no forward: the drafts
    drive its attention through projection methods (DFlash/DSpark project the context keys/values of every layer
    before the block pass; EAGLE-3 steps through TTT), which a layer unit would leave sharded ("mixed torch.Tensor
    and DTensor"). So a decoder layer contributes its MLP, reached only through forward() and most of its weights;
    its attention and norms stay in the root unit, gathered for the whole forward. Every decoder layer counts,
    in a ModuleList or not (EAGLE-3's `midlayer`), and every other ModuleList member is a unit whole.
    """
    from deepspec.drafts.layers import DecoderLayer

    units: list[nn.Module] = []
    for m in draft.modules():
        if isinstance(m, DecoderLayer):
            units.append(m.mlp)
        elif isinstance(m, nn.ModuleList):
            units.extend(block for block in m if not isinstance(block, DecoderLayer))
    return [u for u in units if any(p.requires_grad for p in u.parameters())]


def accumulating(wrapped: nn.Module, last: bool) -> None:
    """Before each micro-batch of an FSDP2 step: reduce gradients only in the step's last backward and never reshard
    after a backward (`release_gathered` does, once the step's backwards are done), so every unit is gathered once
    per optimizer step. Resharding after the last backward instead would gather EAGLE-3's blocks again for each TTT
    step whose backward follows their first post-backward hook (tests/test_precision.py counts the gathers)."""
    if hasattr(wrapped, "set_requires_gradient_sync"):
        wrapped.set_requires_gradient_sync(last)
        wrapped.set_reshard_after_backward(False)


def release_gathered(wrapped: nn.Module) -> None:
    """After a step's last backward (FSDP2): free every unit's gathered weights, so the next forward gathers the weights
    the optimizer is about to update (the shards are the weights; the gathered copies would be stale)."""
    from torch.distributed.fsdp import FSDPModule

    for m in wrapped.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def full_trainable_state(wrapped: nn.Module, parallel: str, is_main: bool) -> dict[str, torch.Tensor] | None:
    """fp32 CPU copy of the draft's trainable weights on rank 0 (collective under FSDP)."""
    if parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        inner = wrapped.module if hasattr(wrapped, "module") and not isinstance(wrapped, LossModule) else wrapped
        sd = inner.state_dict()
    if not is_main:
        return None
    out = {}
    for k, v in sd.items():
        k = k.removeprefix("module.").removeprefix("draft.")
        if k.split(".")[-1] in FROZEN_SUFFIXES:
            continue
        out[k] = v.detach().to("cpu").clone().contiguous()
    return out


def unwrap(wrapped: nn.Module) -> nn.Module:
    m = wrapped.module if not isinstance(wrapped, LossModule) and hasattr(wrapped, "module") else wrapped
    return m.draft
