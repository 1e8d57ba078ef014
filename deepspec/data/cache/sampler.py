"""A stateless, resumable, distributed batch sampler.

The global batch at (epoch, step) is a pure function of (seed, epoch, step, dataset lengths,
global batch size): nothing depends on the number of workers or on what was iterated before.
Resuming therefore only needs (epoch, step), and a run resumed on a different number of
workers sees exactly the same global batches; each rank takes its slice (every world_size-th
sample of the global batch, so ranks get similar lengths).

Length bucketing: the epoch permutation is cut into windows of `bucket_batches` global
batches; inside a window samples are sorted by length and cut into batches, and the order of
those batches is shuffled (seeded). Padding shrinks, randomness across windows is kept, and
the whole thing stays deterministic.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from deepspec.errors import ConfigError


class ResumableBatchSampler:
    """Yields this rank's list of sample indices for each step of the current epoch."""

    def __init__(
        self,
        lengths: Sequence[int],
        global_batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        bucket_batches: int = 0,
    ):
        if global_batch_size < 1 or global_batch_size % world_size:
            raise ConfigError(
                f"The global batch size ({global_batch_size}) must be a positive multiple of the number of workers ({world_size})."
            )
        if len(lengths) < global_batch_size:
            raise ConfigError(
                f"The dataset has {len(lengths)} samples, fewer than one global batch ({global_batch_size}); "
                "lower the batch size or add data."
            )
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world_size {world_size}.")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.bucket_batches = bucket_batches
        self.epoch = 0
        self.step = 0  # next step to yield within the epoch
        self._cache: tuple[int, np.ndarray] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return len(self.lengths) // self.global_batch_size

    def __len__(self) -> int:
        return self.steps_per_epoch - self.step

    def epoch_batches(self, epoch: int) -> np.ndarray:
        """All global batches of an epoch: [steps_per_epoch, global_batch_size] sample indices."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
        perm = rng.permutation(len(self.lengths))
        G, S = self.global_batch_size, self.steps_per_epoch
        perm = perm[: S * G]  # drop the ragged tail (it differs every epoch)
        if self.bucket_batches > 1:
            W = self.bucket_batches * G
            parts = []
            for w in range(0, len(perm), W):
                window = perm[w : w + W]
                window = window[np.argsort(self.lengths[window], kind="stable")]
                batches = window.reshape(-1, G)
                parts.append(batches[rng.permutation(len(batches))])
            batches = np.concatenate(parts)
        else:
            batches = perm.reshape(S, G)
        self._cache = (epoch, batches)
        return batches

    def global_batch(self, epoch: int, step: int) -> list[int]:
        return self.epoch_batches(epoch)[step].tolist()

    def local_batch(self, epoch: int, step: int) -> list[int]:
        return self.global_batch(epoch, step)[self.rank :: self.world_size]

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first step (the DistributedSampler convention)."""
        self.epoch, self.step = epoch, 0

    def __iter__(self) -> Iterator[list[int]]:
        while self.step < self.steps_per_epoch:
            batch = self.local_batch(self.epoch, self.step)
            self.step += 1
            yield batch
        self.epoch, self.step = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """Position of the *next* batch; world size is deliberately absent (it may change on resume).

        A DataLoader with workers prefetches, so this sampler runs ahead of training: a trainer should
        checkpoint the position of the batches it has *consumed* (`position_state(epoch, step)`)."""
        epoch, step = (self.epoch + 1, 0) if self.step >= self.steps_per_epoch else (self.epoch, self.step)
        return self.position_state(epoch, step)

    def position_state(self, epoch: int, step: int) -> dict[str, Any]:
        """The state that resumes at global batch (epoch, step)."""
        return {"seed": self.seed, "epoch": epoch, "step": step, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("global_batch_size", self.global_batch_size) != self.global_batch_size:
            raise ConfigError(
                f"Resuming with a global batch size of {self.global_batch_size}, but the checkpoint used "
                f"{state['global_batch_size']}; keep the global batch size fixed to resume exactly."
            )
        self.seed = int(state.get("seed", self.seed))
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self._cache = None
