"""Block-draft attention as one FlexAttention call per layer (`train.attention: flex`).

The chunked SDPA path (deepspec/drafts/attention.py `block_attention`) makes a few calls per layer, each over the
key range its blocks see plus an additive mask, and computes every masked key of that range. FlexAttention instead
takes one call over [context keys, every block's keys] with a block mask built once per step from the anchors (on the
device, from the plan's tensors: no host read), and its compiled kernel skips the key tiles no query of a tile sees
— the context after the last anchor of a query tile, other blocks' keys. Same visibility as `block_attention`
(tests/test_step_plan.py compares both with the dense reference): block a sees context rows [ctx_start, anchor) of
valid keys when kept (and within the window), and its own K slots (slot j sees slot i when j - i < window).

On CUDA the call and the mask construction are compiled (once per bucketed shape: the context rows are padded to the
plan's `key_rows`); on a CPU the call runs PyTorch's unfused reference, which materialises the scores: for tests.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from deepspec.drafts.attention import BlockBounds, pad_context
from deepspec.errors import ConfigError


# Compiled FlexAttention kernels a run may need: one per (context bucket, window, grad mode). The bucket ladder
# (deepspec/drafts/plan.py `bucket`) has two lengths per doubling, so samples of 64 to 32,768 tokens meet up to 19
# buckets, twice over for windowed layers and again for validation. Past Dynamo's recompile limit (8 by default) a
# new shape would run FlexAttention's unfused reference, which materialises every score: slower by orders of
# magnitude and, at long contexts, out of memory. So the limit is raised to cover every shape a run can meet.
FLEX_RECOMPILE_LIMIT = 128


@lru_cache(maxsize=None)
def _kernels(device_type: str):
    """(flex_attention, create_block_mask): compiled on CUDA (the fused kernel; the mask built by a compiled
    create_block_mask, as torch recommends in place of its deprecated `_compile=True`, which did the same), PyTorch's
    reference elsewhere. One compiled mask builder for every step: a step's new mask_mod closure over new anchors of
    the same shapes reuses its graph (tests/test_step_plan.py counts the compiles on a CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if device_type == "cuda":
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, FLEX_RECOMPILE_LIMIT)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 2 * FLEX_RECOMPILE_LIMIT)
        return torch.compile(flex_attention, dynamic=False), torch.compile(create_block_mask)
    return flex_attention, create_block_mask


def _block_mask(anchors, ctx_start, keep, valid, block: int, window: int | None, n_ctx: int, device):
    """The BlockMask of [B, A*K queries] x [n_ctx context keys, A*K block keys]."""
    _, create_block_mask = _kernels(device.type)
    b_n, a_n = anchors.shape
    keep = keep.bool()
    span = window if window is not None else block

    def mask_mod(b, h, q_idx, kv_idx):
        a = q_idx // block
        slot = q_idx % block
        anc = anchors[b, a]
        ctx_key = kv_idx.clamp(max=n_ctx - 1)
        ctx_ok = (kv_idx < anc) & (kv_idx >= ctx_start[b, a]) & keep[b, a] & valid[b, ctx_key]
        if window is not None:
            ctx_ok = ctx_ok & (anc + slot - kv_idx < window)
        own = kv_idx - n_ctx
        own_ok = (own // block == a) & (slot - own % block < span)
        return torch.where(kv_idx < n_ctx, ctx_ok, own_ok)

    q_len = a_n * block
    return create_block_mask(mask_mod, b_n, None, q_len, n_ctx + q_len, device=device)


def flex_block_attention(q, kb, vb, kc, vc, anchors, ctx_start, keep, key_valid, window: int | None = None,
                         bounds: BlockBounds | None = None) -> torch.Tensor:
    """`block_attention`'s contract (q [B,h,A*K,d]; kb/vb [B,hk,A*K,d]; kc/vc [B,hk,S,d]; anchors / ctx_start / keep
    [B, A]; key_valid [B, S]) in one FlexAttention call. bounds: the plan's BlockBounds; its `key_rows` (bucketed on
    CUDA) sets the padded context length, and its mask cache keeps the step's block mask for every layer."""
    b_n, h, q_n, d = q.shape
    if q.device.type != "cuda" and torch.is_grad_enabled() and any(x.requires_grad for x in (q, kb, vb, kc, vc)):
        raise ConfigError("train.attention=flex trains only on CUDA (PyTorch's FlexAttention has no backward on a CPU); "
                          "use train.attention=sdpa or auto here.")
    a_n = anchors.shape[1]
    block = q_n // a_n
    bounds = bounds if bounds is not None else BlockBounds.of(anchors, ctx_start, keep, kc.shape[2])
    kc, vc, valid = pad_context(kc, vc, key_valid.bool(), bounds.key_rows)
    n_ctx = kc.shape[2]
    key = ("flex", window, q.device)
    if key not in bounds.masks:
        bounds.masks[key] = _block_mask(anchors, ctx_start, keep, valid, block, window, n_ctx, q.device)
    flex, _ = _kernels(q.device.type)
    k = torch.cat([kc, kb], dim=2)
    v = torch.cat([vc, vb], dim=2)
    return flex(q, k, v, block_mask=bounds.masks[key], scale=1.0 / math.sqrt(d), enable_gqa=k.shape[1] != h)
