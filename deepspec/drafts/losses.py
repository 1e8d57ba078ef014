"""Vocabulary-chunked distillation losses: the [rows, V] logits never exist for all rows at once.

`soft_ce` is EAGLE-3's soft cross-entropy against the target's distribution on the draft vocabulary,
with the draft LM head fused in: each chunk of rows computes the draft logits, reads the target's logits
for those rows (computed once per micro-batch by `teacher_logits`), the loss and — in the same pass — the
gradients of the hidden states and the head weight (the loss is linear in each row's weight, so the
gradient is known in the forward; the backward only scales it). Nothing of size [rows, V] is kept for the
backward, and the head matmul runs once forward and twice for gradients, as autograd would.

Precision: head matmuls run in `gemm_dtype` — the autocast dtype where autocast is on (bf16 tensor cores,
fp32 accumulation inside the GEMM), else the operands' own dtype (fp32 CPU runs are unchanged). Everything
after the GEMM — softcap, softmax, log-normalisers, the loss and its gradient — is fp32.

On CUDA, a step that needs only the loss (`loss_only`: unlogged training steps) hands the fused head + loss to
Liger-Kernel's fused linear KL (deepspec/drafts/liger.py) when it is installed: the same algorithm with the softmax,
loss and logit gradient in one Triton pass, fed the same once-per-micro-batch teacher. The eager path here is its
reference and runs everywhere else (CPU, logged steps with their metrics, soft-capped drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepspec.drafts import liger
from deepspec.drafts.amp import autocast_dtype
from deepspec.drafts.layers import softcap


def gemm_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype a head matmul runs in: autocast's where it is on for x's device, else the operands' common dtype."""
    cast = autocast_dtype(x.device.type)
    return cast if cast is not None else torch.promote_types(x.dtype, w.dtype)


@dataclass
class TeacherLabels:
    """The target's distribution for every row of a micro-batch, computed once (`teacher_logits`).

    logits [N, Dv]: the target head's raw (not soft-capped) logits on the draft vocabulary, in the GEMM's dtype
    (bf16 under bf16 autocast: what the served target computes; fp32 in fp32 runs). lse_full / top [N]: the
    soft-capped full-vocabulary log-normaliser and argmax (metrics only; None when not asked for)."""

    logits: torch.Tensor
    lse_full: torch.Tensor | None = None
    top: torch.Tensor | None = None


@torch.no_grad()
def teacher_logits(
    final_hidden: torch.Tensor, lm_head: torch.Tensor, *, chunk: int, draft_ids: torch.Tensor | None = None,
    cap: float | None = None, full_stats: bool = False,
) -> TeacherLabels:
    """final_hidden [N, Ht] (the target's final normed states), lm_head [V, Ht] the target's full head; draft_ids [Dv]
    the target ids of the draft vocabulary (None = all). Row chunks of `chunk` bound the transient [chunk, V] logits.

    full_stats: also the full-vocabulary log-normaliser and argmax per row (acceptance / top-1 metrics): one GEMM
    over the full head per chunk, whose draft-vocabulary columns are the labels, so a logged step adds no second pass."""
    n, c = final_hidden.shape[0], max(1, int(chunk))
    dt = gemm_dtype(final_hidden, lm_head)
    head = lm_head.to(dt)
    rows = head if (draft_ids is None or full_stats) else head[draft_ids]
    dv = head.shape[0] if draft_ids is None else draft_ids.shape[0]
    out = final_hidden.new_empty((n, dv), dtype=dt)
    lse = final_hidden.new_empty(n, dtype=torch.float32) if full_stats else None
    top = final_hidden.new_empty(n, dtype=torch.long) if full_stats else None
    for i in range(0, n, c):
        raw = F.linear(final_hidden[i : i + c].to(dt), rows)
        if full_stats:
            capped = softcap(raw.float(), cap)
            lse[i : i + c] = torch.logsumexp(capped, dim=-1)
            top[i : i + c] = capped.argmax(-1)
            raw = raw if draft_ids is None else raw[:, draft_ids]
        out[i : i + c] = raw
    return TeacherLabels(out, lse, top)


@dataclass
class TeacherDist:
    """The teacher's label distribution softmax(softcap(logits) / T) [M, Dv] and each row's entropy [M], fp32.

    What Liger's fused path (`loss_only` on CUDA) reads at every TTT step: made once per micro-batch
    (`teacher_dist`) instead of once per step — EAGLE-3's 7 steps read the same rows shifted, and the softmax,
    exponent and entropy passes over [rows, Dv] were ~7x repeated work. Bit for bit what the per-step computation gave
    (the same row-wise ops, tests/test_precision.py)."""

    probs: torch.Tensor
    entropy: torch.Tensor

    def __getitem__(self, rows: slice) -> "TeacherDist":
        return TeacherDist(self.probs[rows], self.entropy[rows])


@torch.no_grad()
def teacher_dist(logits: torch.Tensor, cap: float | None, temperature: float, chunk: int) -> TeacherDist:
    """TeacherDist of the teacher's raw draft-vocabulary logits (TeacherLabels.logits), built in row chunks."""
    n, c = logits.shape[0], max(1, int(chunk))
    probs = logits.new_empty(logits.shape, dtype=torch.float32)
    entropy = logits.new_empty(n, dtype=torch.float32)
    for i in range(0, n, c):
        logp = torch.log_softmax(softcap(logits[i : i + c].float(), cap) / temperature, dim=-1)
        p = logp.exp()
        probs[i : i + c] = p
        entropy[i : i + c] = -(p * logp).sum(-1)
    return TeacherDist(probs, entropy)


class _SoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, head, weights, teacher, rows, opts):
        """h [N, H] draft states, head [Dv, H] draft LM head, weights [N] per-row loss weights, teacher [M, Dv] the
        target's raw draft-vocabulary logits (TeacherLabels.logits), rows [N] each row's label row in it (None: row r
        is teacher row r). Returns (sum_r w_r CE_r, CE [N], argmax [N], alpha [N], top-1 match [N])."""
        chunk, temp, cap_d, cap_t, lse_full, t_top, draft_tids, need_grad_h, need_grad_w, head_gemm = opts
        n = h.shape[0]
        dt = gemm_dtype(h, head)
        hw = head_gemm if head_gemm is not None and head_gemm.dtype == dt else head.to(dt)  # one cast per call, not per chunk
        grad_h = torch.zeros_like(h) if need_grad_h else None
        grad_w = torch.zeros(head.shape, dtype=torch.float32, device=head.device) if need_grad_w else None
        ces, argmaxes, alphas, tops = [], [], [], []
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for i in range(0, n, chunk):
            hc = h[i : i + chunk].to(dt)
            logits = softcap(F.linear(hc, hw).float(), cap_d)
            with torch.no_grad():
                sub = teacher[i : i + chunk] if rows is None else teacher.index_select(0, rows[i : i + chunk])
                sub = softcap(sub.float(), cap_t)
                p_t = torch.softmax(sub / temp, dim=-1)
            logp = torch.log_softmax(logits, dim=-1)
            ce = -(p_t * logp).sum(-1)
            w = weights[i : i + chunk].float()
            total = total + (w * ce).sum()
            p_d = logp.exp()
            ces.append(ce)
            argmaxes.append(logits.argmax(-1))
            if lse_full is not None:
                p_full = torch.exp(sub - lse_full[i : i + chunk, None])
                alphas.append(torch.minimum(p_d, p_full).sum(-1))
                tops.append((draft_tids[argmaxes[-1]] == t_top[i : i + chunk]).float())
            if need_grad_h or need_grad_w:
                g = (p_d - p_t) * w[:, None]  # d(w * CE)/d logits (sum_v p_t = 1)
                if cap_d:
                    g = g * (1 - (logits / cap_d) ** 2)
                g = g.to(dt)
                if need_grad_h:
                    grad_h[i : i + chunk] = (g @ hw).to(h.dtype)
                if need_grad_w:
                    grad_w += (g.T @ hc).float()
        ctx.save_for_backward(*(x for x in (grad_h, grad_w) if x is not None))
        ctx.has = (need_grad_h, need_grad_w)
        ctx.head_dtype = head.dtype
        cat = lambda xs, dt_: torch.cat(xs) if xs else h.new_zeros(0, dtype=dt_)  # noqa: E731
        ce_all = cat(ces, torch.float32)
        am = cat(argmaxes, torch.long)
        alpha = cat(alphas, torch.float32) if lse_full is not None else None
        top = cat(tops, torch.float32) if lse_full is not None else None
        outs = [x for x in (ce_all, am, alpha, top) if x is not None]
        ctx.mark_non_differentiable(*outs)
        return (total, ce_all, am, alpha, top)

    @staticmethod
    def backward(ctx, g_total, *_):
        saved = list(ctx.saved_tensors)
        gh = gw = None
        if ctx.has[0]:
            x = saved.pop(0)
            gh = x * g_total.to(x.dtype)
        if ctx.has[1]:
            x = saved.pop(0)
            gw = (x * g_total.to(x.dtype)).to(ctx.head_dtype)
        return gh, gw, None, None, None, None


def takes_fused_path(h: torch.Tensor, loss_only: bool, draft_softcap: float | None,
                     lse_full: torch.Tensor | None = None) -> bool:
    """Whether `soft_ce` hands these rows to Liger's fused kernel: only the loss is read, no metrics' normaliser, no
    draft softcap (the kernel has none), Liger available for h. A caller that prepares for that path asks this."""
    return loss_only and lse_full is None and not draft_softcap and liger.available(h)


def soft_ce(
    h: torch.Tensor,
    head: torch.Tensor,
    weights: torch.Tensor,
    teacher: torch.Tensor,
    rows: torch.Tensor | None = None,
    *,
    chunk: int,
    label_temperature: float = 1.0,
    draft_softcap: float | None = None,
    target_softcap: float | None = None,
    lse_full: torch.Tensor | None = None,
    target_top: torch.Tensor | None = None,
    draft_tids: torch.Tensor | None = None,
    head_gemm: torch.Tensor | None = None,
    loss_only: bool = False,
    dist: TeacherDist | None = None,
):
    """Row-chunked soft CE with the head fused (see the module docstring); gradients flow to h and head.

    teacher [M, Dv]: the target's raw draft-vocabulary logits (`teacher_logits(...).logits`), read at `rows` [N]
    (None: row r reads teacher row r) — EAGLE-3's TTT steps read the same teacher rows shifted, so one table per
    micro-batch serves every step. head_gemm: `head` already cast to the GEMM dtype (saves a cast per call).

    Returns (sum_r weights_r * CE_r [scalar fp32, differentiable], CE [N], draft argmax [N] in draft ids, and when
    lse_full / target_top (the target's full-vocabulary log-normaliser and argmax per row) are given:
    alpha [N] = sum_v min(p_draft, p_target) and the top-1 match [N]; else None, None).

    loss_only: the caller reads only the weighted sum; on CUDA with Liger (and no draft softcap, which its kernel lacks)
    the per-row outputs are then None. dist: `teacher_dist(teacher, target_softcap, label_temperature, chunk)`, made
    once by a caller that calls with the same teacher again (read at `rows` like the teacher; only that path reads it)."""
    if takes_fused_path(h, loss_only, draft_softcap, lse_full):
        return _soft_ce_liger(h, head, weights.detach(), teacher.detach(), rows, max(1, int(chunk)), label_temperature,
                              target_softcap, head_gemm, dist), None, None, None, None
    opts = (max(1, int(chunk)), label_temperature, draft_softcap, target_softcap, lse_full, target_top, draft_tids, h.requires_grad,
            head.requires_grad, head_gemm)
    return _SoftCE.apply(h, head, weights.detach(), teacher.detach(), rows, opts)


def _soft_ce_liger(h, head, weights, teacher, rows, chunk, temp, cap_t, head_gemm, dist=None) -> torch.Tensor:
    """sum_r w_r CE_r through Liger's fused linear KL (see deepspec/drafts/liger.py for the contract): the target rows
    are w_r * p_r in the GEMM dtype, built chunk by chunk in fp32; the value gets back sum_r w_r H(p_r) - w_r log w_r,
    which KL leaves out, so it equals the eager loss (the gradient needs no correction)."""
    dt = gemm_dtype(h, head)
    hw = head_gemm if head_gemm is not None and head_gemm.dtype == dt else head.to(dt)
    n = h.shape[0]
    target = h.new_empty((n, hw.shape[0]), dtype=dt)
    const = torch.zeros((), dtype=torch.float32, device=h.device)
    with torch.no_grad():
        for i in range(0, n, chunk):
            w = weights[i : i + chunk].float()
            if dist is not None:  # the caller's once-per-micro-batch table
                p = dist.probs[i : i + chunk] if rows is None else dist.probs.index_select(0, rows[i : i + chunk])
                ent = dist.entropy[i : i + chunk] if rows is None else dist.entropy.index_select(0, rows[i : i + chunk])
            else:
                d = teacher_dist(teacher[i : i + chunk] if rows is None else teacher.index_select(0, rows[i : i + chunk]),
                                 cap_t, temp, chunk)
                p, ent = d.probs, d.entropy
            const += (w * ent).sum() - torch.xlogy(w, w).sum()
            torch.mul(p, w[:, None], out=target[i : i + chunk])  # rounded to the GEMM dtype as stored: no fp32 copy
    return liger.fused_linear_kl(h.to(dt), hw, target).float() + const
