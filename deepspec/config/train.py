"""Schema of the `train` and `logging` sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from deepspec.errors import ConfigError


@dataclass
class TrainConfig:
    output_root: str = "checkpoints"
    optimizer: Literal["adamw", "muon"] = "adamw"
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    epochs: float = 10.0
    max_steps: int | None = None
    global_batch_size: int = 512
    micro_batch_size: int = 1
    max_tokens_per_batch: int | None = None
    grad_clip: float = 1.0
    parallel: Literal["ddp", "fsdp"] = "ddp"
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    compile: bool = False
    num_workers: int = 0
    seed: int = 0
    save_every: int = 500
    keep_last: int = 3
    val_every: int = 500
    val_max_samples: int = 64
    log_every: int = 10

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be positive, got {self.lr}.")
        if self.global_batch_size < 1 or self.micro_batch_size < 1:
            raise ConfigError("train.global_batch_size and train.micro_batch_size must be >= 1.")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"train.warmup_ratio must be in [0, 1), got {self.warmup_ratio}.")


@dataclass
class LoggingConfig:
    wandb: bool = True
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str | None = None
    wandb_entity: str | None = None
    tensorboard: bool = True
