"""Anchor sampling for block drafts (DFlash, DSpark): `min(num_anchors, valid_i)` anchors per *sample*.

A block draft trains on blocks that start at anchors a with loss_mask[a] & loss_mask[a+1] inside one sample.
Each sample gets its own `num_anchors`, whether it has a row of its own (padded batches) or shares a row with
others (train.pack_tokens): drawing per packed row would give long samples most of the row's anchors and short
ones almost none.

The draw is a keyed hash, not a fresh random tensor per row, so that a sample draws the *same* anchors wherever
it sits: every position gets the score hash(key, fingerprint of its sample's tokens, position inside the sample),
and each sample keeps its num_anchors best-scoring valid positions. `key` is one integer per call: in training the
micro-batch's own seed (its step and place in the global batch, given by the loader), else drawn from torch's
generator (a fixed seed outside training), so draws are fresh every step, deterministic, the same on any worker
count, and identical for a packed batch and the padded batch it was packed from — which makes DraftBatch's
"packed = padded" contract hold for the sampled anchors too. A packed batch costs one host read (the widest row's
anchor count), a padded batch none: the loader draws a training batch's anchors on the CPU before the step
(deepspec/drafts/plan.py), so neither reads the device.
"""

from __future__ import annotations

import torch

# Hash arithmetic stays in int64 without overflow: values < P < 2^31, multipliers < 2^32.
_P = 2**31 - 1
_MULTS = (2654435761, 2246822519, 3266489917)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A non-linear scramble of int64 values in [0, P) (xor-shift then multiply mod P, three rounds)."""
    for m in _MULTS:
        x = ((x ^ (x >> 13)) * m) % _P
    return x


def _segment_starts(seg: torch.Tensor) -> torch.Tensor:
    """[B, T] index of the first column of each column's run of equal values (its sample's first token)."""
    b, t = seg.shape
    ar = torch.arange(t, device=seg.device).expand(b, t)
    first = torch.ones_like(seg, dtype=torch.bool)
    first[:, 1:] = seg[:, 1:] != seg[:, :-1]
    return torch.where(first, ar, torch.zeros_like(ar)).cummax(dim=1).values


def sample_fingerprints(input_ids: torch.Tensor | None, seg: torch.Tensor, pos: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[B, T] int64 in [0, P): a hash of each token's sample (its token ids at their in-sample positions), the same
    for a sample in any row or layout. Without input_ids: the (row, segment) number (draws then depend on layout)."""
    b, t = seg.shape
    slot = torch.arange(b, device=seg.device).unsqueeze(1) * t + seg.clamp(min=0)  # one slot per (row, sample)
    if input_ids is None:
        return _mix(slot % _P)
    term = ((input_ids.long() + 1) % _P * _mix(pos + 1)) % _P
    term = torch.where(real, term, torch.zeros_like(term))
    sums = torch.zeros(b * t, dtype=torch.long, device=seg.device).scatter_add_(0, slot.reshape(-1), term.reshape(-1))
    return _mix(sums.gather(0, slot.reshape(-1)).view(b, t) % _P)


def anchor_key(device: torch.device, seed: int | None = None, key: int | None = None) -> torch.Tensor:
    """[1] int64 in [0, P): this draw's key: `key` itself (reduced into the range), else from torch's generator
    (training) or from `seed` (validation)."""
    if key is not None:
        return torch.full((1,), int(key) % _P, dtype=torch.long, device=device)
    gen = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, _P, (1,), device=device, generator=gen)


def sample_anchors(
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    num_anchors: int,
    segment_ids: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    seed: int | None = None,
    key: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to num_anchors anchors per sample among a with loss_mask[a] & loss_mask[a+1] (same sample).

    Returns (anchors [B, A] ascending per row, keep [B, A]); unused slots are dummies (position 0, keep False).
    A = min(num_anchors, T) for padded batches; for packed ones (segment_ids given) the largest per-row total.
    seed: draw the key from this fixed seed (reproducible validation) instead of torch's generator; key: use this
    key (a training micro-batch's seed) instead of either."""
    b, t = loss_mask.shape
    dev = loss_mask.device
    lm, am = loss_mask.bool(), attention_mask.bool()
    seg = torch.zeros((b, t), dtype=torch.long, device=dev) if segment_ids is None else segment_ids.long()
    real = am & (seg >= 0)
    valid = torch.zeros_like(lm)
    valid[:, :-1] = lm[:, :-1] & lm[:, 1:] & am[:, 1:] & (seg[:, 1:] == seg[:, :-1])
    valid &= real
    ar = torch.arange(t, device=dev).expand(b, t)
    pos = ar - _segment_starts(seg)  # position inside the sample
    fp = sample_fingerprints(input_ids, seg, pos, real)
    score = _mix((fp + _mix(pos + 1) + anchor_key(dev, seed, key)) % _P)  # [B, T] in [0, P)
    # rank each sample's valid positions by score (best first; equal scores: earlier position, as in any layout)
    big = torch.iinfo(torch.long).max
    order_key = torch.where(valid, seg.clamp(min=0) * 2**32 + (_P - 1 - score), torch.full_like(score, big))
    sorted_key, order = order_key.sort(dim=1, stable=True)
    sorted_seg = torch.where(sorted_key < big, sorted_key >> 32, torch.full_like(sorted_key, -1))
    rank = ar - _segment_starts(sorted_seg)
    chosen = torch.zeros_like(valid).scatter_(1, order, (sorted_key < big) & (rank < num_anchors))
    if segment_ids is None:
        width = max(1, min(num_anchors, t))
    else:
        width = max(1, int(chosen.sum(1).max()))  # one host read per packed batch
    top = torch.where(chosen, t - ar, torch.zeros_like(ar)).topk(width, dim=1)  # earliest chosen position first
    keep = top.values > 0
    anchors = torch.where(keep, t - top.values, torch.zeros_like(top.values))
    return anchors, keep
