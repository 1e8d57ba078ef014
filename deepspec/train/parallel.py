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

        # One FSDP unit per repeated block (decoder layers), then the root for the rest.
        for m in list(draft.modules()):
            if isinstance(m, nn.ModuleList):
                for block in m:
                    if any(p.requires_grad for p in block.parameters()):
                        fully_shard(block)
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
