"""Draft attention without dense masks, every call on a fused kernel: memory linear in the sequence length.

Two patterns cover every draft:

* EAGLE-3's TTT chain (`chain_attention`): at step k a query row r sees the step-0 keys of rows <= r (causal) plus
  its own keys from steps 1..k (a diagonal).
* Block drafts (`block_attention`): each block's K queries see context keys in [segment start, anchor) plus their
  own block bidirectionally.

Block drafts: each chunk of blocks is one call over the context keys its blocks see with the chunk's own block keys
appended (a copy of (keys + rows) x d per chunk), and one additive mask showing each query its context range and its
own block: one softmax over both, in the kernel, as the engine computes it. With activation checkpointing on, a
chunk's mask and kernel output are rebuilt in backward (`recompute`), so a layer keeps no mask at all.

The TTT chain: the small part (the diagonal, k keys per row) is computed in fp32 (`ChainParts`: compiled regions
under `train.compile`); the large part (the causal keys) is one flash-kernel call per sample. Where the flash kernel
returns its log-sum-exp to us (PyTorch's CPU kernel; its CUDA one in bf16 / fp16 on sm80+, once `merge_check` has
seen it agree with the sentinel call on that GPU: `flash_lse_ops`) and no window bites, the two parts merge in fp32
through their log-sum-exps, and the backward is blockwise attention's: the flash kernel's own backward handed the
*merged* output and log-sum-exp gives the causal part's gradients exactly, and the diagonal's follow the same formula
by hand (`_ChainFlash`). Elsewhere (CUDA in fp32, a sliding window that bites)
they merge *inside* one SDPA call, which returns no log-sum-exp: a sentinel key whose score is the small part's
log-sum-exp, and whose value marks an extra output channel, joins the call; the kernel's fp32 softmax then gives the
large part its exact normalisation and the small part its share Z_small / (Z_large + Z_small), and out = large +
share * small (added in fp32). (Appending the diagonal keys instead would copy every row's k keys per chunk.) The
sentinel's 8 extra channels cost a head dim of 128 the flash kernel's 192-wide template on CUDA, about twice the
call's time (an H200 profile: 0.97 / 2.47 ms forward / backward a call against 0.51 / 1.29 ms at head dim 128),
which is why the log-sum-exp path is taken wherever it exists.

What each call is, so that CUDA runs it on a fused kernel (tests/test_attention_kernels.py checks every call of a
training step against PyTorch's CUDA rules):

* Head dims stay multiples of 8: the sentinel takes `_EXTRA` = 8 extra channels, not 1. Its score lse / scale rides
  on three of them as hi + mid + lo, each exact in the compute dtype, against key channels of 1: every kernel sums
  exact bf16 products in fp32, so the score is the fp32 log-sum-exp, not a bf16-rounded one (which put the merge off
  by up to ±5%).
* Unwindowed causal parts (EAGLE-3 step 0, the chain's causal part): one `is_causal` call per sample, no mask,
  `enable_gqa` -> the flash kernel. A zero query row in front lets every row see the sentinel key at index 0.
* Windowed chain parts and the block chunks: query chunks over a bounded key range with an additive mask in the
  compute dtype -> the memory-efficient kernel. Its GQA support is recent, so grouped query heads are folded into the
  query axis ([B, kv_heads, group * L, D]) instead of copying keys (or broadcasting them with stride 0, which the
  kernel's backward has not always handled). The chain's key ranges are views of one key tensor that holds a
  sentinel slot before every `_SPAN` keys (the mask shows the range's first one), so chunks copy no keys.

Packed rows (several samples per row, `segment_ids`) and sliding-window layers (key allowed iff q_pos - k_pos <
window, HF/vLLM semantics) are honoured by both. On CPU the same calls run on PyTorch's CPU flash kernel, exact in
fp32 (the golden tests compare them with the dense-mask references at the end, which training never calls).
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from functools import partial

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from deepspec.drafts.amp import autocast_dtype, no_autocast
from deepspec.drafts.plan import Range, bucket, sample_ranges  # noqa: F401  (sample_ranges: re-exported for callers)

# extra q/k/v channels of a sentinel call: a multiple of 8, so head dims stay eligible for the fused kernels
_EXTRA = 8
# real keys between two sentinel slots of a chunked key tensor (bounds the keys a chunk reads before its range)
_SPAN = 256
# mask elements of one chunk call ([B, group * queries, keys]): bounds a chunk's working memory (16 MiB in bf16)
_CHUNK_ELEMENTS = 1 << 23
# on CUDA block chunks may be 8x larger (128 MiB masks in bf16, one per chunk for the step): fewer, bigger calls, where
# every call and its backward's slice gradients cost host time (a 4,096-token DFlash sample: 2 calls per layer)
_CUDA_CHUNK_ELEMENTS = 1 << 26
# query rows per chunk of a sliding-window pass
_WINDOW_CHUNK = 512


# --- helpers --------------------------------------------------------------------------------------------------
def _acc(x: torch.Tensor) -> torch.Tensor:
    """Softmax statistics in at least fp32 (half-precision inputs are upcast, fp64 kept)."""
    return x.float() if x.element_size() < 4 else x


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype SDPA computes in: autocast's where it is on (it casts q/k/v and float masks), else x's."""
    cast = autocast_dtype(x.device.type) if x.is_floating_point() else None
    return cast if cast is not None else x.dtype


# The SDPA kernels a CUDA training step may use, chosen here rather than by the dispatcher: flash for the unmasked
# causal calls, memory-efficient for the masked ones, math only where neither takes the inputs (fp32 heads over 256
# wide). Never cuDNN: it builds an execution plan for every new input shape (10-13 ms of host time a call on an H200
# against 0.2-0.5 ms of GPU work), which left the GPU idle most of a block-draft step.
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _backends(x: torch.Tensor):
    return sdpa_kernel(CUDA_BACKENDS) if x.device.type == "cuda" else contextlib.nullcontext()


def _sdpa(q, k, v, scale, mask=None, is_causal=False):
    with _backends(q):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, buckets: bool, front: int = 0) -> torch.Tensor:
    """is_causal attention with queries and keys at the same rows; with `buckets` the rows are padded at the end to a
    `bucket` length (a row never sees a later one, so the padding changes nothing before it) and cut off again.
    front: rows put in front of the sample's (the sentinel's): the sample's own rows are bucketed, so a 4,096-row
    sample with its sentinel makes a 4,097-row call, not a 6,144-row one."""
    n = q.shape[2]
    extra = bucket(n - front) + front - n if buckets else 0
    if extra:
        q, k, v = (F.pad(x, (0, 0, 0, extra)) for x in (q, k, v))
    out = _sdpa(q, k, v, scale, is_causal=True)
    return out[:, :, :n] if extra else out


def _lse_channels(lse: torch.Tensor, scale: float, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """[..., _EXTRA] query channels carrying lse / scale as hi + mid + lo, each exact in `dtype` (then zeros): against
    key channels of 1 a kernel that sums exact products in fp32 scores the sentinel at the fp32 lse."""
    x = lse / scale
    parts = []
    for _ in range(3):
        p = x.to(dtype).to(x.dtype)
        parts.append(p)
        x = x - p
    ch = torch.stack(parts, dim=-1).to(like.dtype)
    return F.pad(ch, (0, _EXTRA - 3))


def _with_lse(q: torch.Tensor, lse: torch.Tensor, scale: float) -> torch.Tensor:
    """q [..., d] -> [..., d + _EXTRA] with the small part's log-sum-exp in the extra channels."""
    return torch.cat([q, _lse_channels(lse, scale, _compute_dtype(q), q)], dim=-1)


def _extend(k: torch.Tensor, v: torch.Tensor, sentinel_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v [B, hk, n, d] -> [B, hk, n (+1), d + _EXTRA]: zero extra channels, and with sentinel_first a sentinel key
    (channels d..d+2 = 1: it scores the query's lse channels) / value (channel d = 1: it marks the share) in front."""
    d = k.shape[-1]
    front = 1 if sentinel_first else 0
    kx, vx = F.pad(k, (0, _EXTRA, front, 0)), F.pad(v, (0, _EXTRA, front, 0))
    if sentinel_first:
        kx[:, :, 0, d : d + 3] = 1.0
        vx[:, :, 0, d] = 1.0
    return kx, vx


class _Keys:
    """Keys/values [B, hk, n, d] laid out for chunked calls: (with `sentinel`) _EXTRA extra channels and a sentinel slot
    before every _SPAN keys, so keys [lo, hi) plus one sentinel are a view (no copy per chunk)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, sentinel: bool):
        self.sentinel = sentinel
        self.n = k.shape[2]
        if not sentinel:
            self.k, self.v = k, v
            return
        b, hk, n, d = k.shape
        m = -(-n // _SPAN)
        kp = F.pad(k, (0, _EXTRA, 0, m * _SPAN - n)).view(b, hk, m, _SPAN, d + _EXTRA)
        vp = F.pad(v, (0, _EXTRA, 0, m * _SPAN - n)).view(b, hk, m, _SPAN, d + _EXTRA)
        kp, vp = F.pad(kp, (0, 0, 1, 0)), F.pad(vp, (0, 0, 1, 0))  # [B, hk, m, 1 + _SPAN, D]
        kp[:, :, :, 0, d : d + 3] = 1.0
        vp[:, :, :, 0, d] = 1.0
        self.k, self.v = kp.view(b, hk, m * (_SPAN + 1), -1), vp.view(b, hk, m * (_SPAN + 1), -1)

    def span(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys/values of real keys [lo, hi) (and, with a sentinel, the one before them; the slice may start a little
        before lo) -> (k, v, pos [n]: each column's key row (-1 = sentinel), shown [n]: the columns the mask may show)."""
        dev = self.k.device
        if not self.sentinel:
            pos = torch.arange(lo, hi, device=dev)
            return self.k[:, :, lo:hi], self.v[:, :, lo:hi], pos, torch.ones_like(pos, dtype=torch.bool)
        e0 = (lo // _SPAN) * (_SPAN + 1)
        e1 = ((hi - 1) // _SPAN) * (_SPAN + 1) + (hi - 1) % _SPAN + 2
        e = torch.arange(e0, e1, device=dev)
        slot = e % (_SPAN + 1)
        pos = torch.where(slot > 0, (e // (_SPAN + 1)) * _SPAN + slot - 1, torch.full_like(e, -1))
        return self.k[:, :, e0:e1], self.v[:, :, e0:e1], pos, (slot > 0) | (e == e0)


def _additive(vis: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Boolean vis [Bm, L, n] -> additive mask [Bm, 1, group * L, n] in `dtype` (0 / -inf), rows repeated per query head
    of a KV group; the key axis is allocated to a multiple of 8 so the memory-efficient kernel takes it unpadded."""
    bm, lq, n = vis.shape
    n8 = -(-n // 8) * 8
    mask = torch.full((bm, 1, group, lq, n8), float("-inf"), dtype=dtype, device=vis.device)
    mask[..., :n].masked_fill_(vis[:, None, None], 0.0)
    return mask.view(bm, 1, group * lq, n8)[..., :n]


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: torch.Tensor | None, scale: float,
             mask: torch.Tensor | None = None) -> torch.Tensor:
    """Masked attention of q [B, h, L, D] over k/v [B, hk, n, D] (vis [Bm, L, n], Bm in {1, B}) with the query heads of
    each KV head folded into the query axis: [B, hk, group * L, D], one additive mask -> the memory-efficient kernel.
    mask: that additive mask already made (`_additive(vis, group, dtype)`) instead of vis."""
    b, h, lq, dd = q.shape
    hk = k.shape[1]
    g = h // hk
    qf = q.reshape(b, hk, g * lq, dd)
    out = _sdpa(qf, k, v, scale, mask=mask if mask is not None else _additive(vis, g, _compute_dtype(q)))
    return out.reshape(b, h, lq, v.shape[-1])


# --- the TTT chain -------------------------------------------------------------------------------------------
def _causal_range(q, k, v, scale, window, q_offset, sentinel, buckets=False):
    """Causal attention of q [B,h,L,D] over k/v [B,hk,L,d] (query row r at position r + q_offset, keys at their row
    index); with `sentinel` q carries _EXTRA lse channels (D = d + _EXTRA) and every row also sees the sentinel key.
    buckets: unwindowed calls padded to a `bucket` length. Returns [B, h, L, D]."""
    n = q.shape[2]
    if window is None or window >= n + q_offset:
        if not sentinel:
            return _causal(q, k, v, scale, buckets)
        kx, vx = _extend(k, v, sentinel_first=True)
        out = _causal(F.pad(q, (0, 0, 1, 0)), kx, vx, scale, buckets, front=1)
        return out[:, :, 1:]
    keys = _Keys(k, v, sentinel)
    g = q.shape[1] // k.shape[1]
    rows = max(1, min(_WINDOW_CHUNK, _CHUNK_ELEMENTS // (g * (_WINDOW_CHUNK + window + 2))))
    pieces = []
    for c0 in range(0, n, rows):
        c1 = min(n, c0 + rows)
        lo = max(0, c0 + q_offset - window + 1)
        kc, vc, pos, shown = keys.span(lo, c1)
        r = torch.arange(c0, c1, device=q.device)[:, None]
        real = pos >= 0
        vis = real & (pos <= r) & (r + q_offset - pos < window)
        vis = (vis | (shown & ~real))[None]  # the range's own sentinel
        pieces.append(_grouped(q[:, :, c0:c1], kc, vc, vis, scale))
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


@contextlib.contextmanager
def _ieee_fp32(x: torch.Tensor):
    """fp32 matrix products in fp32 on CUDA: training sets TF32 ('high') for the model's fp32 products, whose 10-bit
    mantissa would put the diagonal's scores — and so the merge — off by ~|score| * 2^-11."""
    if x.device.type != "cuda":
        yield
        return
    # the precision API that set_float32_matmul_precision feeds (reading the legacy allow_tf32 after it raises in torch
    # 2.9+, "mix of the legacy and new APIs"); the legacy flag only where the new one does not exist
    matmul = torch.backends.cuda.matmul
    name, ieee = ("fp32_precision", "ieee") if _has_fp32_precision() else ("allow_tf32", False)
    old = getattr(matmul, name)
    setattr(matmul, name, ieee)
    try:
        yield
    finally:
        setattr(matmul, name, old)


def _has_fp32_precision() -> bool:
    try:
        torch.backends.cuda.matmul.fp32_precision  # noqa: B018  (torch 2.9+)
        return True
    except (AttributeError, RuntimeError):
        return False


class ChainParts(nn.Module):
    """The TTT chain's elementwise work around its causal attention call: the diagonal (each row's own chain keys, in
    fp32), its backward, and the merges of the causal call's output with it. Eagerly that is ~30 kernels forward and
    ~40 backward per layer and TTT step over [B, heads, T, head_dim] tensors (fp32 upcasts, exp, batched products,
    slice gradients). A module without parameters so that `train.compile` makes each method a compiled region of a
    few fused kernels (deepspec/train/compile.py). EAGLE-3 owns one (`Eagle3Draft.chain`); `chain_attention` without
    one runs the same methods eagerly. The sentinel call's lse channels (`_lse_channels`) stay eager: their bf16 round
    trips are what some torch versions' Inductor removes."""

    @staticmethod
    def _products(a: torch.Tensor, b: torch.Tensor, eq: str) -> torch.Tensor:
        """einsum `eq` over the diagonal's small axes. Compiled, as a broadcast product and a sum that Inductor fuses
        into one fp32 reduction reading each operand once, where the einsum's batched [g, d] x [d, k] products run
        cuBLAS's fp32 SIMT kernels; eagerly the broadcast would materialise k copies of q, so eager keeps the einsum."""
        if not torch.compiler.is_compiling():
            return torch.einsum(eq, a, b)
        lhs, out = eq.split("->")
        x, y = lhs.split(",")
        axes = "".join(dict.fromkeys(x + y))
        ax = a.permute(*[x.index(c) for c in axes if c in x]).reshape([a.shape[x.index(c)] if c in x else 1 for c in axes])
        by = b.permute(*[y.index(c) for c in axes if c in y]).reshape([b.shape[y.index(c)] if c in y else 1 for c in axes])
        summed = [i for i, c in enumerate(axes) if c not in out]
        r = (ax * by).sum(summed)
        kept = [c for c in axes if c in out]
        return r.permute(*[kept.index(c) for c in out])

    def _scores(self, qg: torch.Tensor, kd: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        """[B, hk, g, T, k] fp32 scores of each row over its own chain keys (steps 1..k; older than `window` masked)."""
        step = kd.shape[3]
        scores = self._products(qg, kd, "bhgtd,bhtjd->bhgtj") * scale
        if window is not None and step >= window:
            j = torch.arange(1, step + 1, device=qg.device)
            scores = scores.masked_fill((step - j >= window).view(1, 1, 1, 1, -1), float("-inf"))
        return scores

    def diagonal(self, q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, scale: float,
                 window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, h, T, d] over each row's own chain keys kd / vd [B, hk, T, k, d] (steps 1..k) in fp32 (bf16 inputs
        upcast exactly; the caller turns autocast and TF32 off): (lse [B, h, T], out [B, h, T, d]). Scores rounded to
        bf16 would put the merge off by ~|score| * 2^-9 in log space."""
        b_n, h, t, d = q.shape
        hk = kd.shape[1]
        qg = _acc(q).reshape(b_n, hk, h // hk, t, d)
        scores = self._scores(qg, _acc(kd), scale, window)
        lse = torch.logsumexp(scores, dim=-1)  # [B, hk, g, T]
        out = self._products(torch.exp(scores - lse.unsqueeze(-1)), _acc(vd), "bhgtj,bhtjd->bhgtd")
        return lse.reshape(b_n, h, t), out.reshape(b_n, h, t, d)

    def diagonal_backward(self, q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, grad: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, scale: float,
                          window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The diagonal's share of the gradients of a merged chain output `out` [B, h, T, d] (log-sum-exp `lse`
        [B, h, T] over every key the row saw), as blockwise attention computes each block's: P = exp(S - lse),
        dS = P * (grad . v - rowsum(grad * out)). Returns fp32 (dq [B, h, T, d], dkd, dvd [B, hk, T, k, d])."""
        b_n, h, t, d = q.shape
        hk = kd.shape[1]
        g = h // hk
        qg = _acc(q).reshape(b_n, hk, g, t, d)
        kd, vd = _acc(kd), _acc(vd)
        go = _acc(grad).reshape(b_n, hk, g, t, d)
        p = torch.exp(self._scores(qg, kd, scale, window) - lse.reshape(b_n, hk, g, t, 1))
        rowsum = (go * _acc(out).reshape(b_n, hk, g, t, d)).sum(-1, keepdim=True)
        ds = p * (self._products(go, vd, "bhgtd,bhtjd->bhgtj") - rowsum)
        dq = self._products(ds, kd, "bhgtj,bhtjd->bhgtd") * scale
        dkd = self._products(ds, qg, "bhgtj,bhgtd->bhtjd") * scale
        dvd = self._products(p, go, "bhgtj,bhgtd->bhtjd")
        return dq.reshape(b_n, h, t, d), dkd, dvd

    def merge(self, out: torch.Tensor, small: torch.Tensor, d: int) -> torch.Tensor:
        """A sentinel call's output [..., d + _EXTRA] + its share (channel d) of the small part's output, in fp32."""
        merged = _acc(out[..., :d]) + _acc(out[..., d : d + 1]) * small
        return merged.to(out.dtype)

    def merge_lse(self, out_l: torch.Tensor, lse_l: torch.Tensor, out_s: torch.Tensor,
                  lse_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The causal part (out_l in the kernel's dtype, its fp32 log-sum-exp lse_l [B, h, T]) and the diagonal (fp32)
        as one softmax over both, in fp32: (out in out_l's dtype, the merged log-sum-exp)."""
        lse = torch.logaddexp(lse_l, lse_s)
        merged = _acc(out_l) * torch.exp(lse_l - lse).unsqueeze(-1) + out_s * torch.exp(lse_s - lse).unsqueeze(-1)
        return merged.to(out_l.dtype), lse


_EAGER_PARTS = ChainParts()


# --- the chain's causal part on a flash kernel that returns its log-sum-exp -----------------------------------------
def _cpu_flash_forward(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _cpu_flash_backward(grad, q, k, v, out, lse, extra, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, True, scale=scale)


def _cuda_flash_forward(q, k, v, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cuda_flash_backward(grad, q, k, v, out, lse, extra, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = extra
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)


def flash_lse_ops(q: torch.Tensor):
    """(forward, backward) of the flash kernel for q's device and dtype that returns the log-sum-exp the chain merges
    with, or None where it has none (the chain then takes the sentinel call): PyTorch's CPU flash kernel (any float
    dtype; also on the meta device), its CUDA one in bf16 / fp16 on sm80+ with head dims it takes, once it has agreed
    with the sentinel call on this GPU (`merge_check`). Both take grouped query heads as they are.
    DEEPSPEC_CHAIN_SENTINEL=1 turns this path off (A/B runs)."""
    if os.environ.get("DEEPSPEC_CHAIN_SENTINEL", "0") == "1":
        return None
    dev = q.device.type
    if dev in ("cpu", "meta"):
        return _cpu_flash_forward, _cpu_flash_backward
    if (dev == "cuda" and torch.version.hip is None and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 and torch.backends.cuda.flash_sdp_enabled()
            and torch.cuda.get_device_capability(q.device) >= (8, 0)):
        ops = (_cuda_flash_forward, _cuda_flash_backward)
        return ops if merge_check(ops, q.device, q.dtype, q.shape[-1]) is None else None
    return None


_MERGE_CHECKS: dict[tuple, str | None] = {}
# mean |diff| over mean |value|: bf16 rounding keeps the two paths within 0.52% on the CPU kernel (dk of step 1, head
# dim 128); a wrong log-sum-exp or backward puts them 16-50% apart (tests/test_attention.py)
_MERGE_TOL = 0.02


def merge_check(ops, device: torch.device, dtype: torch.dtype, d: int) -> str | None:
    """Once per process and (device, dtype, head dim): the chain merged through `ops`' log-sum-exp against the
    sentinel call on a small random input (TTT step 2, grouped-query heads, two packed samples), outputs and input
    gradients. None where they agree; else why not, logged once, and the chain keeps to the sentinel call there.

    Why: the flash ops are PyTorch's private aten ops (`_scaled_dot_product_flash_attention[_backward]`), whose
    log-sum-exp layout or backward contract a torch version or a GPU could change under us; a merge that went wrong
    would train on wrong gradients without a sound. A few milliseconds once, on a generator of its own, never while
    compiling, and in a thread of its own: autocast, grad mode, dispatch modes (the FLOP and launch counters) and an
    activation checkpoint's saved-tensor hooks are per thread, and the caller's (a training forward's) must neither
    shape the check nor see it (under a checkpoint the check's own backward broke the checkpoint's count)."""
    key = (str(device), dtype, d)
    if key in _MERGE_CHECKS:
        return _MERGE_CHECKS[key]
    if torch.compiler.is_compiling():  # checked on the first eager call; a traced one takes the path unchecked
        return None
    box: list[str | None] = []

    def run() -> None:
        dev = torch.device(device)
        # the current CUDA device is per thread too: a new one starts on cuda:0, where any unguarded call would open a
        # context of every rank's process (~0.5 GB each) on the first GPU
        guard = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
        try:
            with guard:
                box.append(_merge_disagreement(ops, dev, dtype, d))
        except Exception as e:  # noqa: BLE001 - a kernel that refuses the call is a disagreement too
            box.append(f"{type(e).__name__}: {e}")

    thread = threading.Thread(target=run, name="deepspec-merge-check", daemon=True)
    thread.start()
    thread.join()
    why = box[0] if box else "the check did not finish"
    _MERGE_CHECKS[key] = why
    if why is not None:
        import logging

        logging.getLogger(__name__).warning(
            "EAGLE-3's TTT attention: merging through the flash kernel's log-sum-exp on %s (%s, head dim %d) disagrees "
            "with the sentinel call (%s); the chain takes the sentinel call here (slower on CUDA, the same attention)",
            device, dtype, d, why)
    return why


def merge_check_failure(device: torch.device | str, dtype: torch.dtype, d: int) -> str | None:
    """Why `merge_check` kept the chain off the flash log-sum-exp on (device, dtype, head dim), if it did (for the
    records a benchmark row keeps)."""
    return _MERGE_CHECKS.get((str(device), dtype, d))


def _merge_disagreement(ops, device: torch.device, dtype: torch.dtype, d: int) -> str | None:
    """`merge_check`'s comparison (in its own thread: no autocast, grad on, no dispatch mode): None, or the first
    output or gradient where the two paths differ."""
    g = torch.Generator(device="cpu").manual_seed(0)
    b, h, hk, t, step = 1, 4, 2, 96, 2

    def make(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 2).to(device=device, dtype=dtype).requires_grad_()

    q, k0, v0 = make(b, h, t, d), make(b, hk, t, d), make(b, hk, t, d)
    diag = [(make(b, hk, t, d), make(b, hk, t, d)) for _ in range(step)]
    leaves = [q, k0, v0, *[x for kv in diag for x in kv]]
    ranges: list[Range] = [(0, 0, 40), (0, 40, t)]  # two packed samples
    w = torch.randn(b, h, t, d, generator=g).to(device)
    results = []
    for sentinel in (False, True):
        out = chain_attention(q, k0, v0, diag, ranges, sentinel=sentinel, flash_ops=ops)
        grads = torch.autograd.grad((out.float() * w).sum(), leaves)
        results.append([out.detach().float(), *[x.float() for x in grads]])
    for name, new, ref in zip(["output", "dq", "dk0", "dv0", *[f"d{kv}{j}" for j in range(1, step + 1) for kv in "kv"]],
                              *results):
        if not torch.isfinite(new).all():
            return f"{name} not finite"
        err, size = (new - ref).abs().mean().item(), ref.abs().mean().item()
        if err > _MERGE_TOL * size + 1e-6:
            return f"{name} differs: mean |diff| {err:.3g} against mean |value| {size:.3g}"
    return None


def _causal_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, forward, buckets: bool):
    """The chain's causal call with its log-sum-exp: (out [B, h, n, d], lse [B, h, n], the kernel's backward state,
    the padded rows' lse). With `buckets` the rows are padded at the end to a `bucket` length, as `_causal` pads (a row
    never sees a later one) — the few shapes a run's calls take stay the same whichever way the chain merges."""
    n = q.shape[2]
    extra = bucket(n) - n if buckets else 0
    if extra:
        q, k, v = (F.pad(x, (0, 0, 0, extra)) for x in (q, k, v))
    out, lse, state = forward(q, k, v, scale)
    return out[:, :, :n], lse[:, :, :n], state, lse[:, :, n:]


class _ChainFlash(torch.autograd.Function):
    """TTT step k >= 1 of one sample, unwindowed: the causal part (step-0 keys) on the flash kernel at the head dim,
    merged in fp32 with the diagonal through both parts' log-sum-exps. Backward as blockwise attention computes it:
    each part's gradient is the softmax over *all* keys, so the flash kernel's own backward, handed the merged output
    and log-sum-exp, gives the causal part's, and `ChainParts.diagonal_backward` the diagonal's."""

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, scale, window, parts, ops, buckets):
        forward, backward = ops
        dtype = _compute_dtype(q)
        qc, kc, vc = (x.to(dtype) for x in (q, k0, v0))
        out_l, lse_l, state, lse_pad = _causal_lse(qc, kc, vc, scale, forward, buckets)
        with no_autocast(q.device.type), _ieee_fp32(q):
            lse_s, out_s = parts.diagonal(q, kd, vd, scale, window)
            out, lse = parts.merge_lse(out_l, lse_l, out_s, lse_s)
        tensors = [x for x in state if isinstance(x, torch.Tensor)]
        ctx.save_for_backward(qc, kc, vc, q, kd, vd, out, lse, lse_pad, *tensors)
        ctx.rest = (scale, window, parts, backward, [None if isinstance(x, torch.Tensor) else x for x in state])
        ctx.dtypes = (q.dtype, k0.dtype, v0.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        qc, kc, vc, q, kd, vd, out, lse, lse_pad, *tensors = ctx.saved_tensors
        scale, window, parts, backward, rest = ctx.rest
        it = iter(tensors)
        state = tuple(next(it) if x is None else x for x in rest)
        n, extra = q.shape[2], lse_pad.shape[2]
        g = grad.to(out.dtype)
        if extra:  # the padded rows: no gradient, their own lse (finite), zero output
            qc, kc, vc, g, out_k = (F.pad(x, (0, 0, 0, extra)) for x in (qc, kc, vc, g, out))
            lse_k = torch.cat([lse, lse_pad], dim=2)
        else:
            out_k, lse_k = out, lse
        dq, dk0, dv0 = (x[:, :, :n] for x in backward(g.contiguous(), qc, kc, vc, out_k, lse_k.contiguous(), state, scale))
        with no_autocast(q.device.type), _ieee_fp32(q):
            dq_s, dkd, dvd = parts.diagonal_backward(q, kd, vd, grad, out, lse, scale, window)
        qt, kt, vt = ctx.dtypes
        return ((dq.float() + dq_s).to(qt), dk0.to(kt), dv0.to(vt), dkd.to(kd.dtype), dvd.to(vd.dtype),
                None, None, None, None, None)


def chain_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    diag: list[tuple[torch.Tensor, torch.Tensor]],
    ranges: list[Range],
    window: int | None = None,
    buckets: bool = False,
    parts: ChainParts | None = None,
    sentinel: bool = False,
    flash_ops=None,
) -> torch.Tensor:
    """TTT step k = len(diag) attention. q [B,h,T,d] (row r at position r+k); k0/v0 [B,hk,T,d] step-0 keys
    (row s at position s); diag: (k_j, v_j) [B,hk,T,d] of steps j = 1..k for each row itself (position r+j).
    ranges: the batch's samples (deepspec.drafts.plan.sample_ranges); buckets: causal calls padded to bucket lengths;
    parts: the draft's ChainParts (compiled regions under train.compile), else eager ones; flash_ops: the flash
    kernel's (forward, backward) to merge through instead of `flash_lse_ops(q)`'s (`merge_check` passes the ones it
    checks). Returns [B, h, T, d].

    Steps k >= 1 merge the causal part with the diagonal through the flash kernel's log-sum-exp where it has one
    (`flash_lse_ops`) and the window does not bite; else (or with `sentinel`) through the sentinel call, whose 8
    extra channels put a head dim of 128 on the flash kernel's 192-wide template on CUDA (~1.9x its time)."""
    step = len(diag)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    if step == 0:
        return _over_ranges(lambda a, b, c: _causal_range(a, b, c, scale, window, 0, False, buckets), ranges, [q, k0, v0], d)
    parts = parts if parts is not None else _EAGER_PARTS
    kd = torch.stack([x[0] for x in diag], dim=3)  # [B, hk, T, k, d]
    vd = torch.stack([x[1] for x in diag], dim=3)
    if sentinel or (window is not None and window < q.shape[2] + step):
        ops = None
    else:
        ops = flash_ops if flash_ops is not None else flash_lse_ops(q)
    if ops is not None:
        return _over_ranges(lambda a, b, c, e, f: _ChainFlash.apply(a, b, c, e, f, scale, window, parts, ops, buckets),
                            ranges, [q, k0, v0, kd, vd], d)
    with no_autocast(q.device.type), _ieee_fp32(q):
        lse_d, out_d = parts.diagonal(q, kd, vd, scale, window)
    qx = _with_lse(q, lse_d, scale)
    out = _over_ranges(lambda a, b, c: _causal_range(a, b, c, scale, window, step, True, buckets), ranges, [qx, k0, v0], d + _EXTRA)
    return parts.merge(out, out_d, d)


# --- block drafts ----------------------------------------------------------------------------------------------
@dataclass
class BlockBounds:
    """Host copies of a batch's anchors and the chunk plans made from them (made once, by the loader on the CPU, and
    shared by every layer: deepspec/drafts/plan.py). length: the batch's context rows; buckets: chunk shapes from a
    short ladder (see `chunks`)."""

    anchors: list[list[int]]
    ctx_start: list[list[int]]
    keep: list[list[bool]]
    length: int = 0
    buckets: bool = False
    _plans: dict = field(default_factory=dict)
    # additive chunk masks made by the first layer that needed them and read by the others (the same anchors and
    # context rows in every layer): keyed by (window, first block, dtype, device)
    masks: dict = field(default_factory=dict)

    @classmethod
    def of(cls, anchors: torch.Tensor, ctx_start: torch.Tensor, keep: torch.Tensor, length: int | None = None,
           buckets: bool = False) -> BlockBounds:
        """From [B, A] tensors (read on the host: made from the CPU batch by the loader). length: context rows (default:
        one past the largest anchor, enough for an unbucketed plan)."""
        a = anchors.tolist()
        n = length if length is not None else 1 + max((max(r) for r in a if r), default=0)
        return cls(a, ctx_start.tolist(), keep.bool().tolist(), n, buckets)

    @property
    def key_rows(self) -> int:
        """Context rows the chunks index: the batch's, or with buckets its `bucket` length (context keys padded)."""
        return bucket(self.length) if self.buckets else self.length

    def _spans(self, window: int | None) -> list[tuple[int, int]]:
        """(lo, hi) per anchor slot: the context keys [lo, hi) any row's block at that slot sees (hi <= lo: none)."""
        a_n = len(self.anchors[0]) if self.anchors else 0
        spans = []
        for a in range(a_n):
            lo, hi = 1 << 62, -1
            for r in range(len(self.anchors)):
                if self.keep[r][a] and self.anchors[r][a] > self.ctx_start[r][a]:
                    s0 = self.ctx_start[r][a] if window is None else max(self.ctx_start[r][a], self.anchors[r][a] - window + 1)
                    lo, hi = min(lo, max(0, s0)), max(hi, self.anchors[r][a])
            spans.append((lo, hi))
        return spans

    def chunks(self, window: int | None, block: int, rows: int, group: int, elements: int | None = None) -> list[tuple[int, int, int, int]]:
        """(a0, a1, lo, hi): blocks a0..a1-1 and the context keys [lo, hi) the call reads (hi <= lo: none).

        Exact (no buckets): grown block by block while the chunk's mask (batch rows x folded query heads x its blocks'
        queries x (context keys + their own keys)) stays within `elements`, each over exactly the keys its blocks
        see. Bucketed: every chunk holds the same number of blocks (the largest divisor of the anchor count whose mask
        fits over all key rows), and reads a `bucket`-long key range that covers its blocks' keys (the mask hides the
        rest): two or three shapes per length bucket instead of one per chunk."""
        elements = _CHUNK_ELEMENTS if elements is None else elements
        key = (window, block, rows, group, elements)
        if key in self._plans:
            return self._plans[key]
        spans = self._spans(window)
        a_n = len(spans)
        plan = []
        if self.buckets:
            t_pad = self.key_rows
            fits = [c for c in range(1, a_n + 1) if a_n % c == 0 and rows * group * c * block * (t_pad + c * block) <= elements]
            c = max(fits, default=1)
            for a0 in range(0, a_n, c):
                lo = min(sp[0] for sp in spans[a0 : a0 + c])
                hi = max(sp[1] for sp in spans[a0 : a0 + c])
                if hi <= lo:
                    plan.append((a0, a0 + c, 0, 0))
                    continue
                n = min(bucket(hi - lo), t_pad)
                lo = min(lo, t_pad - n)
                plan.append((a0, a0 + c, lo, lo + n))
        else:
            a0 = 0
            while a0 < a_n:
                lo, hi = spans[a0]
                a1 = a0 + 1
                while a1 < a_n:
                    nlo, nhi = min(lo, spans[a1][0]), max(hi, spans[a1][1])
                    q_rows = (a1 + 1 - a0) * block
                    if rows * group * q_rows * (max(0, nhi - nlo) + q_rows) > elements:
                        break
                    lo, hi, a1 = nlo, nhi, a1 + 1
                plan.append((a0, a1, lo, hi))
                a0 = a1
        self._plans[key] = plan
        return plan


def pad_context(kc: torch.Tensor, vc: torch.Tensor, valid: torch.Tensor, rows: int):
    """Context keys / values [B, hk, S, d] and their validity [B, S] padded to `rows` (a bucketed key range may reach
    past the batch's rows): padding keys, hidden by `valid`."""
    pad = rows - kc.shape[2]
    if pad <= 0:
        return kc, vc, valid
    return F.pad(kc, (0, 0, 0, pad)), F.pad(vc, (0, 0, 0, pad)), F.pad(valid, (0, pad))


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
    bounds: BlockBounds | None = None,
    recompute: bool = False,
) -> torch.Tensor:
    """Block-draft attention. q [B,h,A*K,d]; kb/vb [B,hk,A*K,d] the blocks' own keys (block a, slot i at
    position anchor + i); kc/vc [B,hk,S,d] context keys (row s); anchors / ctx_start / keep [B, A]: block a
    sees context rows in [ctx_start, anchor) when keep (its sample's first row, so packed samples never mix);
    key_valid [B, S] real context rows; bounds: `BlockBounds.of(anchors, ctx_start, keep, S)` made by the caller from
    host copies (the loader's plan) and shared by every layer; without it the anchors are read here. Returns [B, h, A*K, d], a transposed view of a [B, A*K, h, d] tensor (the layout the output
    projection reads without a copy).

    Each chunk of blocks is one kernel call over its context key range with the chunk's own block keys appended: the
    kernel's fp32 softmax normalises context and own block together (the engine's arithmetic, one rounding of the
    output); nothing is upcast or merged outside it. With `recompute` (the layers' activation checkpointing) a chunk's
    mask, folded queries, keys and kernel output are rebuilt in backward instead of kept: a chunk keeps nothing but
    references to q / k / v, where its mask alone (query heads x rows x keys) would outweigh the output."""
    b_n, h, q_n, d = q.shape
    hk = kc.shape[1]
    a_n = anchors.shape[1]
    k_n = q_n // a_n
    g = h // hk
    scale = 1.0 / math.sqrt(d)
    bounds = bounds if bounds is not None else BlockBounds.of(anchors, ctx_start, keep, kc.shape[2])
    slot = torch.arange(k_n, device=q.device)
    own_vis = slot[:, None] - slot[None, :] < (window if window is not None else k_n)  # [K, K]: key slot j for query slot i
    valid = key_valid.bool()
    kc, vc, valid = pad_context(kc, vc, valid, bounds.key_rows)

    def chunk_mask(a0: int, a1: int, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask [B, 1, group * rows, n_ctx + rows] of blocks a0..a1-1: context keys [lo, hi) as the anchors
        allow, then the chunk's own blocks (each block sees itself). Reads no large tensor (q) of the enclosing scope: a
        recomputed chunk calls it in backward."""
        nb, n_ctx = a1 - a0, max(0, hi - lo)
        pc = torch.arange(lo, lo + n_ctx, device=anchors.device)
        anc, start = anchors[:, a0:a1, None], ctx_start[:, a0:a1, None]
        ctx = (pc < anc) & (pc >= start) & keep[:, a0:a1, None].bool() & valid[:, None, lo : lo + n_ctx]  # [B, nb, n]
        ctx = ctx[:, :, None, :].expand(-1, -1, k_n, -1)
        if window is not None:
            ctx = ctx & ((anc + slot)[..., None] - pc < window)
        own = torch.eye(nb, dtype=torch.bool, device=anchors.device)[:, None, :, None] & own_vis[None, :, None, :]  # [nb, K, nb, K]
        vis = torch.cat([ctx, own.reshape(1, nb, k_n, nb * k_n).expand(b_n, -1, -1, -1)], dim=-1)
        return _additive(vis.reshape(b_n, nb * k_n, -1), g, dtype)

    def chunk(a0: int, a1: int, lo: int, hi: int, mask: torch.Tensor | None, qc, kbc, vbc, kc, vc) -> torch.Tensor:
        # reads no large tensor of the enclosing scope: a recomputed chunk keeps this closure until backward, and a
        # captured q would keep the layer's queries alive through its checkpoint (its mask, None, is rebuilt too)
        n_ctx = max(0, hi - lo)
        if mask is None:
            mask = chunk_mask(a0, a1, lo, hi, _compute_dtype(qc))
        k_all = torch.cat([kc[:, :, lo : lo + n_ctx], kbc], dim=2)
        v_all = torch.cat([vc[:, :, lo : lo + n_ctx], vbc], dim=2)
        out = _grouped(qc, k_all, v_all, None, scale, mask=mask)  # [B, h, rows, d]
        return out.transpose(1, 2)  # [B, rows, h, d]

    plan = bounds.chunks(window, k_n, b_n, g, _CUDA_CHUNK_ELEMENTS if q.device.type == "cuda" else _CHUNK_ELEMENTS)
    # the chunks' rows as one split (its backward concatenates their gradients once; slicing per chunk would make a
    # zero-filled full-size gradient per chunk and add them up)
    sizes = [(a1 - a0) * k_n for a0, a1, _, _ in plan]
    parts = zip(q.split(sizes, dim=2), kb.split(sizes, dim=2), vb.split(sizes, dim=2))
    rebuild = recompute and torch.is_grad_enabled()
    dtype = _compute_dtype(q)
    pieces = []
    for (a0, a1, lo, hi), (qc, kbc, vbc) in zip(plan, parts):
        mask = None
        if not rebuild:  # one mask per chunk for every layer of the step (it holds no gradient)
            mkey = (window, a0, dtype, q.device)
            if mkey not in bounds.masks:
                bounds.masks[mkey] = chunk_mask(a0, a1, lo, hi, dtype)
            mask = bounds.masks[mkey]
        fn = partial(chunk, a0, a1, lo, hi, mask)
        if rebuild:
            pieces.append(checkpoint(fn, qc, kbc, vbc, kc, vc, use_reentrant=False))
        else:
            pieces.append(fn(qc, kbc, vbc, kc, vc))
    return torch.cat(pieces, dim=1).transpose(1, 2)


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
