"""Metric arithmetic on hand-constructed accept patterns (docs/evaluation.md definitions)."""

from __future__ import annotations

import math

import pytest

from deepspec.eval.metrics import AcceptanceStats, TimingStats


def _stats(pattern):
    s = AcceptanceStats()
    for proposed, accepted in pattern:
        s.add_round(proposed, accepted)
    return s


def test_chain_of_three():
    # 4 rounds of 3 drafts, accepted 3, 1, 0, 2
    s = _stats([(3, 3), (3, 1), (3, 0), (3, 2)])
    assert s.tau == pytest.approx((4 + 2 + 1 + 3) / 4)  # 2.5, bonus included
    # α_1: 3 of 4 rounds accept draft 1; α_2: of the 3 that reached draft 2, 2 accept; α_3: 1 of 2
    assert s.acc_cond(1) == pytest.approx(3 / 4)
    assert s.acc_cond(2) == pytest.approx(2 / 3)
    assert s.acc_cond(3) == pytest.approx(1 / 2)
    # s_k = P(A >= k)
    assert [s.survival(k) for k in (1, 2, 3)] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert s.survival(4) == 0.0
    # E[A]@S = sum of s_k = mean min(A, S)
    assert s.expected_accepted(1) == pytest.approx(0.75)
    assert s.expected_accepted(2) == pytest.approx((2 + 1 + 0 + 2) / 4)  # min(A, 2)
    assert s.expected_accepted(3) == pytest.approx(1.5)
    assert s.tau == pytest.approx(1 + s.expected_accepted(3))
    # survival is the running product of the conditional acceptances when every round proposes the chain
    assert s.survival(3) == pytest.approx(s.acc_cond(1) * s.acc_cond(2) * s.acc_cond(3))
    assert (s.proposed, s.accepted, s.rounds, s.generated) == (12, 6, 4, 10)


def test_truncated_proposals_condition_only_on_proposed():
    # DSpark-style confidence truncation: rounds may propose fewer drafts
    s = _stats([(1, 1), (3, 2), (2, 2), (3, 0)])
    # draft 2 was proposed and reachable in rounds 2 and 3 (round 1 proposed only one): both accept it
    assert s.reached[:3] == [4, 2, 1]
    assert s.acc_cond(2) == 1.0
    assert s.acc_cond(3) == 0.0
    # survival is over all rounds, so it is not the product of α when proposals are truncated
    assert s.survival(2) == pytest.approx(2 / 4)
    assert s.tau == pytest.approx((2 + 3 + 3 + 1) / 4)


def test_merge_equals_concatenation_and_roundtrips():
    a = _stats([(3, 3), (3, 1)])
    b = _stats([(5, 4), (3, 0), (2, 2)])
    both = _stats([(3, 3), (3, 1), (5, 4), (3, 0), (2, 2)])
    merged = AcceptanceStats.from_dict(a.to_dict()).merge(b)
    assert merged.to_dict() == both.to_dict()
    assert merged.summary()["acc_cond"] == pytest.approx(both.summary()["acc_cond"])
    assert merged.depth == 5


def test_generated_counts_and_errors():
    s = AcceptanceStats()
    s.add_round(4, 2, num_generated=2)  # e.g. the answer ended at an accepted EOS
    assert s.generated == 2 and s.tau == 3.0
    with pytest.raises(ValueError):
        s.add_round(2, 3)
    empty = AcceptanceStats()
    assert math.isnan(empty.tau) and math.isnan(empty.acc_cond(1)) and math.isnan(empty.expected_accepted(2))


def test_summary_names_never_bare_accept_rate():
    summary = _stats([(2, 1)]).summary()
    assert "accept_rate" not in summary
    assert {"tau", "acc_cond", "survival", "expected_accepted", "proposed_tokens", "accepted_tokens"} <= set(summary)


def test_timing_speedup():
    t = TimingStats(target_tokens=100, target_seconds=4.0, spec_tokens=100, spec_seconds=2.5)
    assert t.target_tokens_per_s == 25.0 and t.spec_tokens_per_s == 40.0
    assert t.speedup == pytest.approx(1.6)
    t2 = TimingStats.from_dict(t.to_dict()).merge(TimingStats(50, 1.0, 50, 1.0))
    assert t2.speedup == pytest.approx((150 / 3.5) / (150 / 5.0))
    assert math.isnan(TimingStats().speedup)


def test_headline_names():
    s = _stats([(3, 3), (3, 1), (3, 0), (3, 2)])
    h = s.summary()
    assert h["acc0"] == h["acc_cond@1"] == pytest.approx(3 / 4)
    assert h["acc_cond@2"] == pytest.approx(2 / 3) and h["acc_cond@3"] == pytest.approx(1 / 2)
    assert h["E[A]@S3"] == pytest.approx(1.5)
    assert h["tau@3"] == pytest.approx(2.5) == pytest.approx(s.tau)
    assert math.isnan(h["E[A]@S7"])  # only 3 drafts per round: a 7-deep figure was not measured
    deep = _stats([(7, 7), (7, 5), (7, 0)])
    assert deep.summary()["E[A]@S7"] == pytest.approx((7 + 5 + 0) / 3)
    assert deep.summary()["tau@3"] == pytest.approx(1 + (3 + 3 + 0) / 3)
