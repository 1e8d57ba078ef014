"""Validation on the held-out cache: the draft's own metrics, reduced token-weighted across ranks.

Drafts report, per depth k (1-based), the teacher-forced acceptance `alpha_tf@k` — the mean over
positions whose drafts 1..k-1 would be accepted of α = Σ_v min(p_draft, p_target) — and
`expected_tau` (1 + Σ_k Π_{i≤k} α_i per position, averaged), plus the greedy simulated τ
(`greedy_tau`: argmax drafts checked against the target's argmax). When a draft reports only the
per-depth α, expected τ is derived here from them (chain of products).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from deepspec.data.batches import collate_fn
from deepspec.train.dist import DistInfo, reduce_metrics
from deepspec.train.staging import feature_dtype
from deepspec.train.weighting import micro_batch_weight

BEST_KEY = "expected_tau"
_ACC = re.compile(r"^alpha_tf@(\d+)$")


def derive(metrics: dict[str, float]) -> dict[str, float]:
    """Add expected_tau from alpha_tf@k when the draft did not report it."""
    out = dict(metrics)
    if BEST_KEY not in out:
        accs = sorted((int(m.group(1)), v) for k, v in out.items() if (m := _ACC.match(k)))
        if accs:
            tau, surv = 1.0, 1.0
            for _, a in accs:
                surv *= a if not math.isnan(a) else 0.0
                tau += surv
            out[BEST_KEY] = tau
    return out


def best_metric(val: dict[str, float] | None) -> tuple[str, float | None]:
    """(key, value) a validation offers for step_best; None unless its loss and value are finite.

    Why the loss too: a NaN batch can leave the value finite (expected τ derived from NaN α counts them as 0), and an
    infinite value would outrank every later validation."""
    if not val or not math.isfinite(val.get(BEST_KEY, math.nan)) or not math.isfinite(val.get("loss", 0.0)):
        return BEST_KEY, None
    return BEST_KEY, float(val[BEST_KEY])


@torch.no_grad()
def run_validation(wrapped: torch.nn.Module, data: Any, cfg, info: DistInfo, autocast) -> dict[str, float]:
    """Evaluate up to `train.val_max_samples` held-out samples, split over ranks.

    Every rank runs the same number of forwards (FSDP all-gathers in each); surplus ones repeat a
    batch and are not counted. Online held-out data runs the same target as the loader thread's training batches:
    its forwards take turns with those (deepspec/data/cache/online.py: target_lock), since tap hooks would catch
    both.
    """
    n = min(len(data), cfg.train.val_max_samples)
    bs = cfg.train.val_batch_size
    mine = list(range(info.rank, n, info.world))
    chunks = [mine[i : i + bs] for i in range(0, len(mine), bs)]
    per_rank = math.ceil(math.ceil(n / info.world) / bs) if n else 0
    collate = collate_fn(data)
    dtype = feature_dtype(cfg.train.precision, info.device)  # as the training batches are staged (train/staging.py)
    sums: dict[str, list[float]] = {}
    loss_num = loss_den = 0.0
    was_training = wrapped.training
    wrapped.eval()
    try:
        for j in range(per_rank):
            real = j < len(chunks)
            idx = chunks[j] if real else [0]
            batch = collate([data[i] for i in idx]).to(info.device, dtype)
            with autocast():
                loss, metrics = wrapped(batch)
            if not real:
                continue
            # token-weighted whatever train.loss_normalization says: validation figures compare across runs
            weight, _ = micro_batch_weight(metrics, batch.num_loss_tokens, batch.input_ids.numel(), "tokens")
            loss_num += float(loss) * float(weight)
            loss_den += float(weight)
            for k, (num, den) in metrics.items():
                acc = sums.setdefault(k, [0.0, 0.0])
                acc[0] += float(num)
                acc[1] += float(den)
    finally:
        wrapped.train(was_training)
    sums["loss"] = [loss_num, loss_den]
    # ranks without data still need the same keys for the collective
    if torch.distributed.is_initialized() and info.world > 1:
        gathered: list[Any] = [None] * info.world
        torch.distributed.all_gather_object(gathered, sorted(sums))
        for ks in gathered:
            for k in ks:
                sums.setdefault(k, [0.0, 0.0])
    return derive(reduce_metrics(sums, info.device))
