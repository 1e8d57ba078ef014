"""Non-finite steps: a step whose loss or gradient norm is NaN / inf does not update the weights.

Why: one bad batch (a corrupt feature row, an overflow) would otherwise write NaN into every weight and every later
step would train on them, while checkpoints and `step_best` kept pointing at a broken model. The check costs one host
sync per step (a single `.item()` of a two-element tensor, after the gradients are reduced); the loss is the global
one and the gradient norm is taken over the reduced gradients, so every rank reaches the same verdict without
another collective. A skipped step still advances the step counter and the schedule (its data is consumed), so a
resumed run replays the same steps. `train.max_nonfinite_steps` such steps in a row stop training with an error;
the checkpoints already written are left as they are, the newest being the last good one.
"""

from __future__ import annotations

from typing import Any

import torch

from deepspec.errors import DeepSpecError
from deepspec.log import get_logger

log = get_logger(__name__)


class NonFiniteLossError(DeepSpecError):
    """Training stopped after too many non-finite steps in a row."""


class NonFiniteGuard:
    """Decides, once per step, whether the optimizer may step."""

    def __init__(self, max_in_row: int, plan: Any, dataset: Any, is_main: bool):
        self.max_in_row = max_in_row
        self.plan, self.dataset, self.is_main = plan, dataset, is_main
        self.in_row = 0
        self.skipped: list[int] = []

    def ok(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor | float) -> bool:
        """True when the loss and the gradient norm of (1-based) `step` are finite; otherwise log and count it."""
        values = torch.stack([loss_sum.detach().double().reshape(()), torch.as_tensor(grad_norm).detach().double().to(loss_sum.device).reshape(())])
        if bool(torch.isfinite(values).all().item()):  # the one host sync per step
            self.in_row = 0
            return True
        self.in_row += 1
        self.skipped.append(step)
        if self.is_main:
            loss, norm = (float(v) for v in values.cpu())
            log.warning("step %d skipped: loss %s, gradient norm %s (not finite; no weight update); its samples: %s",
                        step, loss, norm, ", ".join(self._sample_ids(step)))
        if self.max_in_row and self.in_row >= self.max_in_row:
            raise NonFiniteLossError(
                f"{self.in_row} steps in a row (up to step {step}) had a non-finite loss or gradient norm, so training "
                f"stopped; the checkpoints written so far are untouched. Lower train.lr, check the data of the samples "
                f"logged above (or rebuild the cache), then rerun to resume from step_latest."
            )
        return False

    def _sample_ids(self, step: int) -> list[str]:
        try:
            idx = self.plan.global_indices(step - 1)
        except Exception:  # noqa: BLE001 - logging must never break training
            return ["?"]
        name = getattr(self.dataset, "sample_id", None)
        out = []
        for i in idx:
            try:
                out.append(str(name(i)) if callable(name) else f"#{i}")
            except Exception:  # noqa: BLE001
                out.append(f"#{i}")
        return out
