"""Engine-backed eval: counter arithmetic and the served-as-trained verdict (the real engine: test_conformance_vllm.py)."""

from __future__ import annotations

import pytest

from deepspec.eval.engine import compare
from deepspec.eval.metrics import AcceptanceStats
from deepspec.data.engines.server import counters_delta


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


def test_dflash_is_served_and_compared_at_its_training_block():
    """vLLM's DFlash drafts num_speculative_tokens + 1 slots and never reads block_size: S must be block_size - 1."""
    from deepspec.config import load_config
    from deepspec.errors import ConfigError
    from deepspec.eval.engine import engine_speculative_tokens

    dflash = {"algorithm": "dflash", "model": {"block_size": 8}}
    assert engine_speculative_tokens(load_config(None, ["eval.num_draft_tokens=7"]), dflash) == 7
    assert engine_speculative_tokens(load_config(None, ["eval.num_draft_tokens=7", "eval.engine_num_speculative_tokens=7"]), dflash) == 7
    with pytest.raises(ConfigError, match="block_size=8"):
        engine_speculative_tokens(load_config(None, ["eval.num_draft_tokens=7", "eval.engine_num_speculative_tokens=3"]), dflash)
    with pytest.raises(ConfigError, match="num_draft_tokens >= 7"):
        engine_speculative_tokens(load_config(None, ["eval.num_draft_tokens=5"]), dflash)
    eagle = {"algorithm": "eagle3", "model": {"ttt_length": 7}}
    assert engine_speculative_tokens(load_config(None, ["eval.num_draft_tokens=7", "eval.engine_num_speculative_tokens=3"]), eagle) == 3
    assert engine_speculative_tokens(load_config(None, ["eval.num_draft_tokens=5"]), eagle) == 5


def test_served_speedup_arithmetic():
    from deepspec.eval.engine import speedups

    spec = {"gsm8k": {"single": {"tokens": 100, "seconds": 2.0, "tokens_per_s": 50.0}, "concurrent": {"tokens": 100, "seconds": 1.0, "tokens_per_s": 100.0}},
            "mtbench": {"single": {"tokens": 50, "seconds": 2.0, "tokens_per_s": 25.0}, "concurrent": {"tokens": 50, "seconds": 1.0, "tokens_per_s": 50.0}}}
    base = {"gsm8k": {"single": {"tokens": 100, "seconds": 4.0, "tokens_per_s": 25.0}, "concurrent": {"tokens": 100, "seconds": 1.0, "tokens_per_s": 100.0}},
            "mtbench": {"single": {"tokens": 50, "seconds": 2.0, "tokens_per_s": 25.0}, "concurrent": {"tokens": 50, "seconds": 2.0, "tokens_per_s": 25.0}}}
    sp = speedups(spec, base)
    assert sp["gsm8k"]["single"]["speedup"] == pytest.approx(2.0) and sp["gsm8k"]["concurrent"]["speedup"] == pytest.approx(1.0)
    assert sp["overall"]["single"]["spec_tokens_per_s"] == pytest.approx(150 / 4) and sp["overall"]["single"]["baseline_tokens_per_s"] == pytest.approx(150 / 6)
    assert sp["overall"]["concurrent"]["speedup"] == pytest.approx((150 / 2) / (150 / 3))


def test_served_speedup_prompt_selection():
    from deepspec.config import load_config
    from deepspec.errors import ConfigError
    from deepspec.eval.engine import speedup_tasks

    by_task = {"heldout": list(range(30)), "gsm8k": list(range(4))}
    cfg = load_config(None, ["eval.engine_speedup_tasks=[heldout]", "eval.engine_speedup_max_samples=16"])
    assert speedup_tasks(cfg, by_task) == {"heldout": list(range(16))}
    assert speedup_tasks(load_config(None, ["eval.engine_speedup_max_samples=2"]), by_task) == {"heldout": [0, 1], "gsm8k": [0, 1]}
    with pytest.raises(ConfigError, match="not eval tasks"):
        speedup_tasks(load_config(None, ["eval.engine_speedup_tasks=[mbpp]"]), by_task)
    with pytest.raises(ConfigError, match="engine_speedup_max_samples"):
        load_config(None, ["eval.engine_speedup_max_samples=0"])


def test_served_speedup_times_a_warm_server():
    """A fresh server's first request is slow (one-off costs): it is sent once untimed before either mode is timed,
    so a cold baseline cannot make a draft look faster than it is."""
    import time
    from types import SimpleNamespace

    from deepspec.eval.engine import time_tasks

    class Server:  # 10 tokens a conversation, 10 ms each once warm, the first one 400 ms
        def __init__(self):
            self.completion_tokens, self.calls = 0, 0

        def conversation(self, turns, seed, system=None):
            self.calls += 1
            time.sleep(0.4 if self.calls == 1 else 0.01)
            self.completion_tokens += 10
            return 0

    items = [SimpleNamespace(index=i, row={"turns": ["hi"]}) for i in range(3)]
    server = Server()
    timed = time_tasks(server, {"heldout": items}, seed=0)
    assert server.calls == 1 + 2 * len(items)  # the warm-up, then each mode over every conversation
    for mode in ("single", "concurrent"):
        assert timed["heldout"][mode]["tokens"] == 30 and timed["heldout"][mode]["seconds"] < 0.3, timed


@pytest.mark.parametrize("algo, why", [("dspark", "adaptive verification"), ("dflash2", "candidate walk")])
def test_a_draft_only_vllms_gpu_runner_serves_is_refused_with_its_reason(algo, why, tmp_path):
    from deepspec.config import load_config
    from deepspec.errors import ConfigError
    from deepspec.eval.engine import engine_eval

    cfg = load_config(None, ["eval.engine=vllm"])
    with pytest.raises(ConfigError, match=f"cannot serve '{algo}' drafts \\(.*{why}.*eval.engine=none"):
        engine_eval(cfg, tmp_path, {"algorithm": algo, "model": {}}, "unused", [], {}, tmp_path)
