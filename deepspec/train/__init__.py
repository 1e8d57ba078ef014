"""train stage: `train(cfg)` in this process, `launch(cfg, nproc)` for N torchrun workers.

Modules: loop (the loop), parts (what it trains), batches (global-batch plan), optim (AdamW/Muon + warmup-cosine),
parallel (DDP/FSDP2), checkpoint (step_N, step_latest, step_best, exact resume), loggers
(wandb/tensorboard), validate (held-out τ), launcher/worker (torchrun), build (default parts).
"""

from __future__ import annotations


def train(cfg, parts=None):
    from deepspec.train.loop import train as _train

    return _train(cfg, parts)


def launch(cfg, nproc: int, torchrun_args=(), env=None):
    from deepspec.train.launcher import launch as _launch

    return _launch(cfg, nproc, torchrun_args, env)


__all__ = ["train", "launch"]
