"""What the loop trains: a draft, its data, and how to write it — built from a config by train/build.py, or handed
to `train(cfg, parts)` by a caller (a benchmark's random features, a test's scalar model). Its own module so that the
builder and the loop both import it and neither imports the other back."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class TrainParts:
    """What the loop trains: a draft, its data, and how to write it. Built from the config by default."""

    model: nn.Module
    train_data: Any  # len(), [i] -> sample dict, optional .collate / .lengths
    val_data: Any | None = None
    provenance: dict[str, Any] = field(default_factory=dict)
    # write_draft(directory, fp32 trainable state dict) -> writes config.json + model.safetensors
    write_draft: Callable[[Path, dict[str, torch.Tensor]], None] | None = None
    # run once when training ends in this process, before train() returns (a streamed run's producers finishing the
    # kept cache): an in-process caller then finds everything the run writes written
    on_finish: list[Callable[[], None]] = field(default_factory=list)
