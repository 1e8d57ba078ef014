"""Vocabulary-chunked distillation losses: the [rows, V] logits never exist for all rows at once.

`soft_ce` is EAGLE-3's soft cross-entropy against the target's distribution on the draft vocabulary,
with the draft LM head fused in: each chunk of rows computes the draft logits, the target's soft labels
(from its cached final hidden states, chunk by chunk), the loss and — in the same pass — the gradients
of the hidden states and the head weight (the loss is linear in each row's weight, so the gradient is
known in the forward; the backward only scales it). Nothing of size [rows, V] is kept for the backward,
and the head matmul runs once forward and twice for gradients, as autograd would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepspec.drafts.layers import softcap


def _acc_dtype(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.element_size() < 4 else x


class _SoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, head, weights, fh, target_rows, opts):
        """h [N, H] draft states, head [Dv, H] draft LM head, weights [N] per-row loss weights,
        fh [N, Ht] target final states of each row's label, target_rows [Dv, Ht] the target head's rows
        for the draft vocabulary. Returns (sum_r w_r CE_r, CE [N], argmax [N], alpha [N], top-1 match [N])."""
        chunk, temp, cap_d, cap_t, lse_full, t_top, draft_tids, need_grad_h, need_grad_w, pre = opts
        n = h.shape[0]
        grad_h = torch.zeros_like(h) if need_grad_h else None
        grad_w = torch.zeros(head.shape, dtype=torch.float32 if head.element_size() < 4 else head.dtype, device=head.device) if need_grad_w else None
        ces, argmaxes, alphas, tops = [], [], [], []
        total = weights.new_zeros((), dtype=torch.float32 if weights.element_size() < 4 else weights.dtype)
        for i in range(0, n, chunk):
            hc = h[i : i + chunk]
            raw = F.linear(hc, head)
            logits = _acc_dtype(softcap(raw, cap_d))
            with torch.no_grad():
                if pre is not None:  # the caller computed the target's draft-vocabulary logits once for all steps
                    sub = pre[i : i + chunk]
                else:
                    with torch.autocast(device_type=fh.device.type, enabled=False):  # labels in fp32 under bf16 autocast too
                        sub = softcap(fh[i : i + chunk].float() @ target_rows.float().T, cap_t)
                p_t = torch.softmax(sub / temp, dim=-1)
            logp = torch.log_softmax(logits, dim=-1)
            ce = -(p_t * logp).sum(-1)
            w = weights[i : i + chunk].to(ce.dtype)
            total = total + (w * ce).sum()
            p_d = logp.exp()
            ces.append(ce)
            argmaxes.append(logits.argmax(-1))
            if lse_full is not None:
                p_full = torch.exp(sub - lse_full[i : i + chunk, None])
                alphas.append(torch.minimum(p_d, p_full).sum(-1))
                tops.append((draft_tids[argmaxes[-1]] == t_top[i : i + chunk]).to(ce.dtype))
            if need_grad_h or need_grad_w:
                g = (p_d - p_t) * w[:, None]  # d(w * CE)/d logits (sum_v p_t = 1)
                if cap_d:
                    g = g * (1 - (logits / cap_d) ** 2)
                g = g.to(raw.dtype)
                if need_grad_h:
                    grad_h[i : i + chunk] = (g @ head.to(g.dtype)).to(h.dtype)
                if need_grad_w:
                    grad_w += (g.T @ hc.to(g.dtype)).to(grad_w.dtype)
        ctx.save_for_backward(*(x for x in (grad_h, grad_w) if x is not None))
        ctx.has = (need_grad_h, need_grad_w)
        ctx.head_dtype = head.dtype
        cat = lambda xs, dt: torch.cat(xs) if xs else h.new_zeros(0, dtype=dt)  # noqa: E731
        ce_all = cat(ces, total.dtype)
        am = cat(argmaxes, torch.long)
        alpha = cat(alphas, total.dtype) if lse_full is not None else None
        top = cat(tops, total.dtype) if lse_full is not None else None
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


def soft_ce(
    h: torch.Tensor,
    head: torch.Tensor,
    weights: torch.Tensor,
    fh: torch.Tensor,
    target_rows: torch.Tensor,
    *,
    chunk: int,
    label_temperature: float = 1.0,
    draft_softcap: float | None = None,
    target_softcap: float | None = None,
    lse_full: torch.Tensor | None = None,
    target_top: torch.Tensor | None = None,
    draft_tids: torch.Tensor | None = None,
    target_logits: torch.Tensor | None = None,
):
    """Row-chunked soft CE with the head fused (see the module docstring); gradients flow to h and head.

    Returns (sum_r weights_r * CE_r [scalar, differentiable], CE [N], draft argmax [N] in draft ids, and when
    lse_full / target_top (the target's full-vocabulary log-normaliser and argmax per row) are given:
    alpha [N] = sum_v min(p_draft, p_target) and the top-1 match [N]; else None, None).

    target_logits [N, Dv] (fp32, soft-capped): the target's draft-vocabulary logits of each row, when the caller
    can afford to hold them (then fh / target_rows are not read): EAGLE-3's TTT steps read the same target rows
    shifted, so a small [T, Dv] computed once saves a matmul per step."""
    opts = (max(1, int(chunk)), label_temperature, draft_softcap, target_softcap, lse_full, target_top, draft_tids, h.requires_grad,
            head.requires_grad, target_logits)
    return _SoftCE.apply(h, head, weights.detach(), fh, target_rows, opts)


def target_full_stats(final_hidden: torch.Tensor, lm_head: torch.Tensor, cap: float | None, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's full-vocabulary log-normaliser and argmax per row ([N] each), computed in row chunks."""
    lses, tops = [], []
    for i in range(0, final_hidden.shape[0], max(1, int(chunk))):
        tl = softcap((final_hidden[i : i + chunk].float() @ lm_head.float().T).float(), cap)
        lses.append(torch.logsumexp(tl, dim=-1))
        tops.append(tl.argmax(-1))
    if not lses:
        return final_hidden.new_zeros(0, dtype=torch.float32), final_hidden.new_zeros(0, dtype=torch.long)
    return torch.cat(lses), torch.cat(tops)
