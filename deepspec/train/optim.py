"""Optimizers and the learning-rate schedule.

`adamw`: AdamW on every trainable parameter (no weight decay on 1-D norms/biases).
`muon`: Muon (deepspec/train/muon.py: torch.optim.Muon's update, Newton–Schulz in bf16 only where the
hardware computes bf16) on the 2-D hidden weight matrices of the draft body (attention, MLP, the fc that
fuses the taps), AdamW on everything else: output heads (a trainable `lm_head`, DSpark's Markov head and
its embeddings, the confidence head), embedding tables, norms and biases — as the DFlash recipes and
Muon's authors do (an output head's rows are per-token classifiers, not a hidden map to orthogonalise).
Frozen target embeddings / LM head are buffers in every draft, so they never reach an optimizer.

Learning rates. `train.muon_lr` set: Muon's matrices step at muon_lr with Muon's original shape scaling
(x sqrt(max(1, rows/cols))) and everything else at `train.lr` — the published DFlash recipe's
"muon_lr 0.02, lr 6e-4". `train.muon_lr` null: one lr for both, Muon's update RMS-matched to AdamW's
(x 0.2 sqrt(max(rows, cols)), torch's `match_rms_adamw`).
"""

from __future__ import annotations

import math
import re

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


# Output heads and their companions: matrices, but not hidden maps of the draft body.
_HEAD_RE = re.compile(r"(^|\.)(lm_head|markov_head|confidence_head|embed[a-z_]*)(\.|$)")


def split_muon_params(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(Muon's, AdamW's) trainable (name, parameter) pairs.

    Muon: 2-D matrices of the draft body (both sides > 1). AdamW: output heads (`lm_head`, `markov_head`,
    `confidence_head`), embedding tables, anything named embed*, vectors (norms, biases) and 1-row maps.
    A draft can add names with a `muon_exclude` attribute (an iterable of parameter-name prefixes)."""
    embeds = _embedding_params(model)
    extra = tuple(getattr(model, "muon_exclude", ()) or ())
    muon, adam = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        clean = name.replace("_orig_mod.", "").removeprefix("module.").removeprefix("draft.")
        body_matrix = (
            p.ndim == 2 and min(p.shape) > 1 and id(p) not in embeds and not _HEAD_RE.search(clean)
            and not (extra and clean.startswith(extra))
        )
        (muon if body_matrix else adam).append((clean, p))
    return muon, adam


def describe_param_groups(model: nn.Module, cfg: TrainConfig) -> str:
    """One line for the start-of-training log: which parameters each optimizer takes, at which lr."""
    if cfg.optimizer == "adamw":
        n = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return f"optimizer adamw: all {n:,} trainable parameters at lr {cfg.lr:g}"
    muon, adam = split_muon_params(model)

    def summary(pairs):
        names = sorted({re.sub(r"\.\d+\.", ".*.", n) for n, _ in pairs})
        return f"{sum(p.numel() for _, p in pairs):,} params [{', '.join(names)}]"

    muon_lr = cfg.muon_lr if cfg.muon_lr is not None else cfg.lr
    scaling = "original" if cfg.muon_lr is not None else "match_rms_adamw"
    return (f"optimizer muon: Muon lr {muon_lr:g} ({scaling} scaling) on {summary(muon)}; "
            f"AdamW lr {cfg.lr:g} on {summary(adam)}")


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Parameter groups by shape; raises a ConfigError when nothing is trainable."""
    if len(cfg.betas) != 2:
        raise ConfigError(f"train.betas needs two numbers (beta1, beta2), got {cfg.betas}.")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ConfigError("The draft has no trainable parameters; check model.* settings.")
    if cfg.muon_lr is not None and cfg.muon_lr <= 0:
        raise ConfigError(f"train.muon_lr must be positive (or null for train.lr), got {cfg.muon_lr}.")
    adam_kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.optimizer == "adamw":
        decay = [p for _, p in params if p.ndim >= 2]
        no_decay = [p for _, p in params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], **adam_kw)
    muon_pairs, adam_pairs = split_muon_params(model)
    matrices = [p for _, p in muon_pairs]
    adam_groups = [
        {"params": [p for _, p in adam_pairs if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for _, p in adam_pairs if p.ndim < 2], "weight_decay": 0.0},
    ]
    opts: list[torch.optim.Optimizer] = []
    if matrices:
        explicit = cfg.muon_lr is not None
        opts.append(
            Muon(
                matrices, lr=cfg.muon_lr if explicit else cfg.lr, weight_decay=cfg.weight_decay,
                momentum=cfg.muon_momentum, adjust_lr_fn="original" if explicit else "match_rms_adamw",
                shard=cfg.muon_shard,
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
