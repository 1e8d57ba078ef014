"""Draft attention without dense masks: memory linear in the sequence length.

Two patterns cover every draft:

* EAGLE-3's TTT chain (`chain_attention`): at step k a query row r sees the step-0 keys of rows <= r
  (causal) plus its own keys from steps 1..k (a diagonal). The causal part is one flash SDPA call
  (`is_causal`, no mask); the diagonal is k dot products per row. They are merged exactly with the
  diagonal's log-sum-exp through a *sentinel* key: every query gets one extra dimension holding the
  diagonal's LSE, a sentinel key (zero except 1/scale there) scores exactly that LSE, and its value
  (zero except a 1 in an extra channel) returns the diagonal's share Z_d / (Z_c + Z_d) of the softmax.
  So out = causal_part + share * diagonal_output, and autograd flows through the ordinary SDPA backward.
* Block drafts (`block_attention`): each block's K queries see context keys in [segment start, anchor)
  plus their own block bidirectionally. The own-block part is a small [A, K, K] attention; the context
  part runs over chunks of blocks (a bounded [G*K, S] mask per chunk), merged by the same sentinel.

Packed rows (several samples per row, `segment_ids`) and sliding-window layers (key allowed iff
q_pos - k_pos < window, HF/vLLM semantics) are honoured by both. The dense-mask functions at the end
are the reference the tests compare against; training never calls them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# (row, start, end): one contiguous sample of a batch row; row None = every row (unpacked layout)
Range = tuple[int | None, int, int]

# elements of one block-attention chunk's mask ([G*K, S]): bounds the context part's working memory
_BLOCK_CHUNK_ELEMENTS = 1 << 22
# query rows per chunk of a sliding-window causal pass
_WINDOW_CHUNK = 512


def sample_ranges(segment_ids: torch.Tensor | None, batch: int, length: int) -> list[Range]:
    """Contiguous samples of each row from `segment_ids` [B, T] (-1 = padding, skipped); None = one per row.

    One host read of the ids per loss call (not per layer or step): the causal SDPA needs the bounds."""
    if segment_ids is None:
        return [(None, 0, length)]
    seg = segment_ids.detach().cpu()
    out: list[Range] = []
    for b in range(batch):
        row = seg[b]
        cuts = ((row[1:] != row[:-1]).nonzero().squeeze(1) + 1).tolist()
        for s, e in zip([0] + cuts, cuts + [length]):
            if int(row[s]) >= 0:
                out.append((b, s, e))
    return out


def _with_extra(x: torch.Tensor, extra: torch.Tensor | float) -> torch.Tensor:
    """Append one channel to the last dimension."""
    if not torch.is_tensor(extra):
        extra = x.new_full(x.shape[:-1], float(extra))
    return torch.cat([x, extra.unsqueeze(-1).to(x.dtype)], dim=-1)


def _sentinel(k: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sentinel key/value [B, hk, 1, D] for keys already carrying the extra channel (the last one): the
    key scores a query's extra channel, the value marks it."""
    b, hk, _, dx = k.shape
    ks = k.new_zeros(b, hk, 1, dx)
    ks[..., -1] = 1.0 / scale
    vs = k.new_zeros(b, hk, 1, dx)
    vs[..., -1] = 1.0
    return ks, vs


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Softmax statistics in at least fp32 (half-precision scores are upcast, fp64 kept)."""
    return x.float() if x.element_size() < 4 else x


def _sdpa(q, k, v, scale, mask=None, is_causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def _causal_range(q, k, v, scale, window, q_offset, sentinel):
    """Causal attention of q [B,h,L,D] over k/v [B,hk,L,D] (query row r at position r + q_offset, keys at
    their row index), optionally with a sentinel key every row sees. Returns [B, h, L, D]."""
    n = q.shape[2]
    if window is None or window >= n + q_offset:
        if sentinel is None:
            return _sdpa(q, k, v, scale, is_causal=True)
        ks, vs = sentinel
        qx = torch.cat([q.new_zeros(q.shape[0], q.shape[1], 1, q.shape[3]), q], dim=2)
        out = _sdpa(qx, torch.cat([ks, k], dim=2), torch.cat([vs, v], dim=2), scale, is_causal=True)
        return out[:, :, 1:]
    pieces = []
    for c0 in range(0, n, _WINDOW_CHUNK):
        c1 = min(n, c0 + _WINDOW_CHUNK)
        lo = max(0, c0 + q_offset - window + 1)
        r = torch.arange(c0, c1, device=q.device)[:, None]
        s = torch.arange(lo, c1, device=q.device)[None, :]
        mask = (s <= r) & (r + q_offset - s < window)
        kc, vc = k[:, :, lo:c1], v[:, :, lo:c1]
        if sentinel is not None:
            mask = torch.cat([mask.new_ones(c1 - c0, 1), mask], dim=1)
            kc, vc = torch.cat([sentinel[0], kc], dim=2), torch.cat([sentinel[1], vc], dim=2)
        pieces.append(_sdpa(q[:, :, c0:c1], kc, vc, scale, mask=mask))
    return torch.cat(pieces, dim=2)


def _over_ranges(fn, ranges: list[Range], tensors: list[torch.Tensor], out_dim: int) -> torch.Tensor:
    """Run fn(*tensors sliced to one range) on each range, reassembling [B, h, T, out_dim] (zeros elsewhere)."""
    q = tensors[0]
    if len(ranges) == 1 and ranges[0][0] is None:
        return fn(*tensors)
    b_n, h, t, _ = q.shape
    rows = []
    for b in range(b_n):
        pieces, at = [], 0
        for rb, s, e in ranges:
            if rb != b:
                continue
            if s > at:
                pieces.append(q.new_zeros(1, h, s - at, out_dim))
            pieces.append(fn(*[x[b : b + 1, :, s:e] for x in tensors]))
            at = e
        if at < t:
            pieces.append(q.new_zeros(1, h, t - at, out_dim))
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0)


def chain_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    diag: list[tuple[torch.Tensor, torch.Tensor]],
    ranges: list[Range],
    window: int | None = None,
) -> torch.Tensor:
    """TTT step k = len(diag) attention. q [B,h,T,d] (row r at position r+k); k0/v0 [B,hk,T,d] step-0 keys
    (row s at position s); diag: (k_j, v_j) [B,hk,T,d] of steps j = 1..k for each row itself (position r+j).
    Returns [B, h, T, d]."""
    step = len(diag)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    if step == 0:
        return _over_ranges(lambda a, b, c: _causal_range(a, b, c, scale, window, 0, None), ranges, [q, k0, v0], d)
    b_n, h, t, _ = q.shape
    hk = k0.shape[1]
    g = h // hk
    kd = torch.stack([x[0] for x in diag], dim=3)  # [B, hk, T, k, d]
    vd = torch.stack([x[1] for x in diag], dim=3)
    qg = q.view(b_n, hk, g, t, d)
    scores = torch.einsum("bhgtd,bhtjd->bhgtj", qg, kd) * scale
    if window is not None and step >= window:
        j = torch.arange(1, step + 1, device=q.device)
        scores = scores.masked_fill((step - j >= window).view(1, 1, 1, 1, -1), float("-inf"))
    lse_d = torch.logsumexp(_acc(scores), dim=-1)  # [B, hk, g, T]
    out_d = torch.einsum("bhgtj,bhtjd->bhgtd", torch.softmax(_acc(scores), dim=-1).to(vd.dtype), vd).reshape(b_n, h, t, d)
    qx = _with_extra(q, lse_d.reshape(b_n, h, t))
    kx, vx = _with_extra(k0, 0.0), _with_extra(v0, 0.0)

    def part(qr, kr, vr):
        return _causal_range(qr, kr, vr, scale, window, step, _sentinel(kr, scale))

    out = _over_ranges(part, ranges, [qx, kx, vx], d + 1)
    return out[..., :d] + out[..., d:] * out_d


def block_attention(
    q: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    anchors: torch.Tensor,
    ctx_start: torch.Tensor,
    keep: torch.Tensor,
    key_valid: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """Block-draft attention. q [B,h,A*K,d]; kb/vb [B,hk,A*K,d] the blocks' own keys (block a, slot i at
    position anchor + i); kc/vc [B,hk,S,d] context keys (row s); anchors / ctx_start / keep [B, A]: block a
    sees context rows in [ctx_start, anchor) when keep (its sample's first row, so packed samples never mix);
    key_valid [B, S] real context rows. Returns [B, h, A*K, d]."""
    b_n, h, q_n, d = q.shape
    hk, s_n = kc.shape[1], kc.shape[2]
    a_n = anchors.shape[1]
    k_n = q_n // a_n
    g = h // hk
    scale = 1.0 / math.sqrt(d)
    # own block, bidirectional: [B, hk, g, A, K, K]
    qb = q.view(b_n, hk, g, a_n, k_n, d)
    scores = torch.einsum("bhgaid,bhajd->bhgaij", qb, kb.view(b_n, hk, a_n, k_n, d)) * scale
    if window is not None and k_n > window:
        i = torch.arange(k_n, device=q.device)
        scores = scores.masked_fill((i[:, None] - i[None, :] >= window), float("-inf"))
    lse_o = torch.logsumexp(_acc(scores), dim=-1)  # [B, hk, g, A, K]
    out_o = torch.einsum("bhgaij,bhajd->bhgaid", torch.softmax(_acc(scores), dim=-1).to(vb.dtype), vb.view(b_n, hk, a_n, k_n, d))
    out_o = out_o.reshape(b_n, h, q_n, d)
    # context part, chunks of G blocks, merged through the sentinel (every row sees it: no empty rows)
    qx = _with_extra(q, lse_o.reshape(b_n, h, q_n))
    kx, vx = _with_extra(kc, 0.0), _with_extra(vc, 0.0)
    ks, vs = _sentinel(kx, scale)
    kx, vx = torch.cat([ks, kx], dim=2), torch.cat([vs, vx], dim=2)
    slot = torch.arange(k_n, device=q.device)
    s_idx = torch.arange(s_n, device=q.device)
    per = max(1, _BLOCK_CHUNK_ELEMENTS // max(1, b_n * k_n * (s_n + 1)))
    pieces = []
    for a0 in range(0, a_n, per):
        a1 = min(a_n, a0 + per)
        anc = anchors[:, a0:a1]
        vis = (s_idx[None, None, :] < anc[..., None]) & (s_idx[None, None, :] >= ctx_start[:, a0:a1, None])
        vis = vis & keep[:, a0:a1, None] & key_valid.bool()[:, None, :]  # [B, G, S]
        vis = vis[:, :, None, :].expand(-1, -1, k_n, -1)  # [B, G, K, S]
        if window is not None:
            qpos = anc[..., None] + slot  # [B, G, K]
            vis = vis & (qpos[..., None] - s_idx < window)
        vis = vis.reshape(b_n, (a1 - a0) * k_n, s_n)
        mask = torch.cat([vis.new_ones(b_n, vis.shape[1], 1), vis], dim=2)[:, None]
        pieces.append(_sdpa(qx[:, :, a0 * k_n : a1 * k_n], kx, vx, scale, mask=mask))
    out = torch.cat(pieces, dim=2)
    return out[..., :d] + out[..., d:] * out_o


# --- dense-mask references (tests only) --------------------------------------------------------------
def _dense(q, k, v, mask):
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def dense_chain_reference(q, k0, v0, diag, segment_ids=None, window=None):
    """The [T, (k+1)T] mask the TTT chain used to build: causal (same sample, within the window) + k diagonals."""
    t = q.shape[2]
    step = len(diag)
    r = torch.arange(t, device=q.device)
    base = (r[None, :] <= r[:, None])[None].expand(q.shape[0], -1, -1)
    if segment_ids is not None:
        base = base & (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, :, None] >= 0)
    if window is not None:
        base = base & ((r[:, None] + step - r[None, :]) < window)
    eyes = [torch.eye(t, dtype=torch.bool, device=q.device)[None].expand(q.shape[0], -1, -1) & (step - j < (window or 1 << 62)) for j in range(1, step + 1)]
    mask = torch.cat([base] + eyes, dim=2)[:, None]
    # padding rows of a packed layout see nothing in `base`; give them their own key (their output is unused)
    if segment_ids is not None:
        mask = mask.clone()
        mask[:, 0, :, :t] |= torch.eye(t, dtype=torch.bool, device=q.device) & (segment_ids < 0)[:, :, None]
    keys = torch.cat([k0] + [x[0] for x in diag], dim=2)
    values = torch.cat([v0] + [x[1] for x in diag], dim=2)
    return _dense(q, keys, values, mask)


def dense_block_mask(anchors, ctx_start, keep, key_valid, block_size, window=None):
    """[B, 1, A*K, S + A*K] boolean: what block_attention computes, as one dense mask."""
    b_n, a_n = anchors.shape
    s_n = key_valid.shape[1]
    k_n = block_size
    s_idx = torch.arange(s_n, device=anchors.device)
    q_anchor = anchors.repeat_interleave(k_n, dim=1)
    q_start = ctx_start.repeat_interleave(k_n, dim=1)
    q_keep = keep.repeat_interleave(k_n, dim=1)
    q_pos = q_anchor + torch.arange(k_n, device=anchors.device).repeat(a_n)
    ctx = (s_idx[None, None] < q_anchor[..., None]) & (s_idx[None, None] >= q_start[..., None]) & key_valid.bool()[:, None] & q_keep[..., None]
    block_id = torch.arange(a_n, device=anchors.device).repeat_interleave(k_n)
    own = (block_id[:, None] == block_id[None, :]).expand(b_n, -1, -1)
    if window is not None:
        ctx = ctx & (q_pos[..., None] - s_idx < window)
        slot = torch.arange(k_n, device=anchors.device).repeat(a_n)
        own = own & ((slot[:, None] - slot[None, :]) < window)
    return torch.cat([ctx, own], dim=2).unsqueeze(1)


def dense_block_reference(q, kb, vb, kc, vc, anchors, ctx_start, keep, key_valid, window=None):
    mask = dense_block_mask(anchors, ctx_start, keep, key_valid, q.shape[2] // anchors.shape[1], window)
    return _dense(q, torch.cat([kc, kb], dim=2), torch.cat([vc, vb], dim=2), mask)
