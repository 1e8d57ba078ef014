"""How each micro-batch weighs in a step's loss (train.loss_normalization).

`tokens` (default): the step's loss is the mean over every supervised token of the global batch; a micro-batch's
mean loss weighs by its supervised-token count (or by the draft's own `_loss_weight`: EAGLE-3's step-0 rows, a block
draft's sum of prediction weights). Long answers weigh more than short ones, whatever the batching.

`positions`: each micro-batch's loss is its supervised sum divided by its B x T positions (padding, packing slack and
prompt tokens included) and micro-batches count equally: the per-B·T normalisation of DeepSpec's trainers. A sample
with a long prompt and a short answer weighs less, and how samples fall into micro-batches changes the weights.
Drafts normalise each TTT step / block row by its own count inside the micro-batch, so this equals DeepSpec's
per-step B·T division up to the few rows later TTT steps lose at the end of each answer.

benchmarks/bench_loss_normalization.py measures both on the quickstart's data, served by vLLM.
"""

from __future__ import annotations

from typing import Any

import torch

from deepspec.drafts.base import LOSS_WEIGHT

MODES = ("tokens", "positions")


def micro_batch_weight(metrics: dict[str, Any], n_tok: int, positions: int, mode: str = "tokens"
                       ) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """(weight of the micro-batch's mean loss, its share of the step's denominator).

    The step's loss is sum(weight x mean loss) / sum(share) over the global batch. The draft's reserved
    `_loss_weight` metric is popped here (it is not logged)."""
    pair = metrics.pop(LOSS_WEIGHT, None)
    if pair is None:
        weight: torch.Tensor | float = float(n_tok)
    else:
        w = pair[0] if isinstance(pair, (tuple, list)) else pair
        weight = w.float().reshape(()) if isinstance(w, torch.Tensor) else float(w)
    if mode == "tokens":
        return weight, weight
    if mode == "positions":
        # the supervised sum over B*T: the mean loss times its token weight, over the batch's positions
        return weight / max(int(positions), 1), 1.0
    raise ValueError(f"unknown loss normalisation {mode!r}")  # validated in TrainConfig
