"""Optimizers and the learning-rate schedule.

`adamw`: AdamW on every trainable parameter (no weight decay on 1-D norms/biases).
`muon`: Muon (deepspec/train/muon.py: torch.optim.Muon's update, Newton–Schulz in bf16 only where the
hardware computes bf16) on 2-D hidden weight matrices, AdamW on the rest (1-D parameters and
embedding tables), as the DFlash recipes do. Frozen target embeddings / LM head are buffers in
every draft, so they never reach an optimizer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deepspec.config.train import TrainConfig
from deepspec.errors import ConfigError
from deepspec.train.muon import Muon


class MultiOptimizer(torch.optim.Optimizer):
    """Several optimizers stepped together; one state_dict and one param_groups list for the scheduler."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        self.defaults = {}
        self.state = {}  # unused; each member keeps its own
        self._opt_groups = None

    @property
    def param_groups(self):  # type: ignore[override]
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self, closure=None):  # type: ignore[override]
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):  # type: ignore[override]
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict) -> None:  # type: ignore[override]
        for o, s in zip(self.optimizers, state_dict["optimizers"], strict=True):
            o.load_state_dict(s)


def _embedding_params(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Parameter groups by shape; raises a ConfigError when nothing is trainable."""
    if len(cfg.betas) != 2:
        raise ConfigError(f"train.betas needs two numbers (beta1, beta2), got {cfg.betas}.")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ConfigError("The draft has no trainable parameters; check model.* settings.")
    embeds = _embedding_params(model)
    decay = [p for _, p in params if p.ndim >= 2]
    no_decay = [p for _, p in params if p.ndim < 2]
    adam_kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.optimizer == "adamw":
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], **adam_kw)
    matrices = [p for p in decay if p.ndim == 2 and id(p) not in embeds]
    rest_decay = [p for p in decay if not (p.ndim == 2 and id(p) not in embeds)]
    adam_groups = [{"params": rest_decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opts: list[torch.optim.Optimizer] = []
    if matrices:
        opts.append(
            Muon(
                matrices, lr=cfg.muon_lr or cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                adjust_lr_fn="match_rms_adamw",
            )
        )
    adam_groups = [g for g in adam_groups if g["params"]]
    if adam_groups:
        opts.append(torch.optim.AdamW(adam_groups, **adam_kw))
    return MultiOptimizer(opts) if len(opts) > 1 else opts[0]


def warmup_cosine(total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    """lr multiplier: linear warmup from ~0 to 1 over ceil(ratio*total) steps, then cosine to min_lr_ratio."""
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        span = max(1, total_steps - warmup)
        progress = min(1.0, (step - warmup) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    for g in optimizer.param_groups:
        g.setdefault("initial_lr", g["lr"])
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(total_steps, cfg.warmup_ratio, cfg.min_lr_ratio)
    )
