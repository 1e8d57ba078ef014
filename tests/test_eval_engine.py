"""Engine-backed eval: counter arithmetic and the served-as-trained verdict (the real engine: test_conformance_vllm.py)."""

from __future__ import annotations

import pytest

from deepspec.eval.engine import compare
from deepspec.eval.metrics import AcceptanceStats
from deepspec.serving import counters_delta


def test_compare_engine_counters_with_ours_at_S():
    # ours: chains of 5 drafts; engine: S=3
    ours = AcceptanceStats()
    for a in (5, 2, 0, 3, 1):
        ours.add_round(5, a)
    before = {"drafts": 10.0, "draft_tokens": 30.0, "accepted_tokens": 12.0, "accepted_per_pos": [6.0, 4.0, 2.0]}
    after = {"drafts": 15.0, "draft_tokens": 45.0, "accepted_tokens": 20.0, "accepted_per_pos": [10.0, 7.0, 3.0]}
    delta = counters_delta(before, after)
    c = compare(ours.summary(), delta, 3)
    # engine: 5 drafts, 8 accepted -> tau 2.6; per position 4/5, 3/5, 1/5
    assert c["engine_tau"] == pytest.approx(2.6)
    assert c["engine_survival"] == pytest.approx([0.8, 0.6, 0.2])
    # ours restricted to S=3: 1 + mean min(A, 3) = 1 + (3+2+0+3+1)/5
    assert c["ours_tau_at_S"] == pytest.approx(1 + 9 / 5)
    assert c["ours_tau"] == pytest.approx(1 + 11 / 5)
    assert c["ours_survival"] == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert c["relative_diff"] == pytest.approx((2.6 - 2.8) / 2.8)
    assert c["survival_relative_diff"] == pytest.approx([0.0, 0.0, (0.2 - 0.4) / 0.4])
    nothing = {"drafts": 5.0, "accepted_tokens": 0.0, "mean_acceptance_length": 1.0, "acceptance_rate_per_pos": [0.0, 0.0]}
    ours_nothing = {"expected_accepted": [0.0, 0.0], "survival": [0.0, 0.0]}
    assert compare(ours_nothing, nothing, 2)["survival_relative_diff"] == [0.0, 0.0]  # both accept nothing: agreement


def test_served_as_trained_is_decided_per_depth_only_on_aligned_greedy_rounds():
    from deepspec.eval.engine import served_as_trained

    close = {"survival_relative_diff": [0.01, -0.04, 0.03]}
    far = {"survival_relative_diff": [0.01, -0.02, -0.30]}  # a deep depth off: what a wrong tap or norm does
    assert served_as_trained(close, greedy=True, aligned=True) == {
        "decided": True, "ok": True, "tolerance": 0.05, "worst_depth": 2, "worst_relative_diff": -0.04}
    bad = served_as_trained(far, greedy=True, aligned=True)
    assert bad["decided"] and not bad["ok"] and bad["worst_depth"] == 3
    assert not served_as_trained({"survival_relative_diff": [0.0, None]}, greedy=True, aligned=True)["ok"]  # ours 0, engine not
    for kw in ({"greedy": False, "aligned": True}, {"greedy": True, "aligned": False}):
        v = served_as_trained(far, **kw)
        assert not v["decided"] and v["why"]
    assert not served_as_trained({"survival_relative_diff": None}, greedy=True, aligned=True)["decided"]  # other protocols
