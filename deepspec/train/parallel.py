"""Wrapping the draft for data parallelism (DDP or FSDP2) behind one `forward(batch)`.

Drafts expose `loss(batch)`, not `forward`; DDP and FSDP2 only hook `forward`, so a thin module
routes forward -> loss. Frozen target embedding / LM head are buffers: DDP does not reduce them
and FSDP2 does not shard them (each worker keeps one copy, no optimizer state).
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


def wrap(draft: nn.Module, parallel: str, world: int, device: torch.device) -> nn.Module:
    module = LossModule(draft)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for unit in fsdp_units(draft):
            fully_shard(unit)
        fully_shard(module)
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
    its attention and norms stay in the root unit, gathered for the whole forward.
    """
    from deepspec.drafts.layers import DecoderLayer

    units = []
    for m in draft.modules():
        if isinstance(m, nn.ModuleList):
            for block in m:
                unit = block.mlp if isinstance(block, DecoderLayer) else block
                if any(p.requires_grad for p in unit.parameters()):
                    units.append(unit)
    return units


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
