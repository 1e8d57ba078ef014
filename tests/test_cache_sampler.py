"""The resumable sampler: batch order is a pure function of (seed, epoch, step)."""

from __future__ import annotations

import numpy as np
import pytest

from deepspec.data.cache.sampler import ResumableBatchSampler
from deepspec.errors import ConfigError

LENGTHS = np.random.default_rng(0).integers(5, 500, size=203)


def run(sampler: ResumableBatchSampler, steps: int) -> list[list[int]]:
    """`steps` batches, starting a new epoch (a new `iter`, as a training loop does) when one ends."""
    out: list[list[int]] = []
    while len(out) < steps:
        for b in sampler:
            out.append(b)
            if len(out) == steps:
                break
    return out


@pytest.mark.parametrize("bucket", [0, 4])
def test_epoch_is_a_permutation_and_seeded(bucket):
    s = ResumableBatchSampler(LENGTHS, 8, seed=1, bucket_batches=bucket)
    batches = list(s)
    assert len(batches) == 203 // 8 and all(len(b) == 8 for b in batches)
    flat = [i for b in batches for i in b]
    assert len(set(flat)) == len(flat) == 25 * 8  # no sample twice in an epoch
    again = list(ResumableBatchSampler(LENGTHS, 8, seed=1, bucket_batches=bucket))
    assert again == batches
    assert list(ResumableBatchSampler(LENGTHS, 8, seed=2, bucket_batches=bucket)) != batches
    assert s.epoch == 1 and list(s) != batches  # the next epoch is shuffled differently


def test_resume_restores_the_exact_next_batch():
    ref = ResumableBatchSampler(LENGTHS, 8, seed=5, bucket_batches=4)
    full = run(ref, 40)  # crosses the epoch boundary (25 steps per epoch)
    a = ResumableBatchSampler(LENGTHS, 8, seed=5, bucket_batches=4)
    run(a, 30)
    state = a.state_dict()
    b = ResumableBatchSampler(LENGTHS, 8, seed=0, bucket_batches=4)  # the seed comes from the state
    b.load_state_dict(state)
    assert run(b, 10) == full[30:]


def test_different_world_size_sees_the_same_global_batches():
    one = ResumableBatchSampler(LENGTHS, 8, seed=7, bucket_batches=4)
    global_batches = run(one, 12)
    state = ResumableBatchSampler(LENGTHS, 8, seed=7, bucket_batches=4)
    run(state, 5)
    st = state.state_dict()
    ranks = []
    for r in range(4):  # resume the 1-worker run on 4 workers
        s = ResumableBatchSampler(LENGTHS, 8, seed=7, rank=r, world_size=4, bucket_batches=4)
        s.load_state_dict(st)
        ranks.append(run(s, 7))
    for step in range(7):
        parts = [ranks[r][step] for r in range(4)]
        assert all(len(p) == 2 for p in parts)
        assert sorted(i for p in parts for i in p) == sorted(global_batches[5 + step])


def test_bucketing_reduces_padding():
    def padded(bucket: int) -> int:
        s = ResumableBatchSampler(LENGTHS, 8, seed=3, bucket_batches=bucket)
        return sum(int(LENGTHS[b].max()) * len(b) for b in s)

    assert padded(8) < 0.8 * padded(0)


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match="multiple of the number of workers"):
        ResumableBatchSampler(LENGTHS, 6, world_size=4)
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        ResumableBatchSampler(LENGTHS[:3], 8)
    s = ResumableBatchSampler(LENGTHS, 8)
    with pytest.raises(ConfigError, match="global batch size"):
        s.load_state_dict({"epoch": 0, "step": 1, "global_batch_size": 16})
