"""One conversation of a cache plan: where its line is in the input file and how long it renders.

Why its own module: the plan (plan.py) and the plan kept on disk (plan_cache.py) both build samples, and neither
should import the other's machinery to do so."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass


class Sample:
    """One conversation to capture. The plan keeps only where it is and how long it is (so a plan of
    millions of samples stays small and cheap to hand to workers); tokens are re-rendered per shard."""

    id: str
    input_ids: np.ndarray | None  # int32 [T] (None until materialized)
    loss_mask: np.ndarray | None  # uint8 [T]
    truncated: bool
    length: int = 0
    offset: int = -1  # byte offset of its line in the input JSONL

    def __post_init__(self) -> None:
        if self.input_ids is not None:
            self.length = len(self.input_ids)
