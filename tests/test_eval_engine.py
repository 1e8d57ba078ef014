"""Engine-backed eval: counter arithmetic, and (slow, vllm) the real vLLM engine with an exported draft."""

from __future__ import annotations

import json

import pytest
import torch

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


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_engine_eval_random_eagle3_at_t1(tmp_path, smollm2_dir):
    """Export an (untrained) EAGLE-3 draft for SmolLM2, serve it with vLLM's CPU build at T = 1 and compare counters
    with ours under the same protocol (greedy drafts, vLLM started with draft_sample_method=greedy). The CPU build
    cannot honour a per-request seed (its worker dies), so the requests go unseeded — before that fix this eval ended
    with "vLLM answered 500". A random draft is accepted almost never on both sides: the comparison is like for like,
    not a test of acceptance agreement."""
    pytest.importorskip("vllm")
    from transformers import AutoConfig

    from deepspec.config import load_config
    from deepspec.config.model import ModelConfig
    from deepspec.drafts.checkpoint import save_draft
    from deepspec.drafts.registry import get_algorithm
    from deepspec.eval.runner import evaluate

    torch.manual_seed(0)
    draft = get_algorithm("eagle3").from_target_config(AutoConfig.from_pretrained(smollm2_dir), ModelConfig(algorithm="eagle3"))
    ckpt = save_draft(draft, tmp_path / "step_0", provenance={"target": "smollm2-135m-instruct", "target_path": str(smollm2_dir)})
    d = tmp_path / "ds"
    d.mkdir()
    (d / "gsm8k.jsonl").write_text(json.dumps({"turns": ["What is 2 + 3? Answer briefly."]}) + "\n")
    cfg = load_config(None, [
        f"eval.datasets_dir={d}", "eval.tasks=[gsm8k]", "eval.max_new_tokens=24", "eval.num_draft_tokens=3",
        "eval.temperature=1.0", "eval.draft_sample_method=greedy",
        "eval.engine=vllm", "eval.measure_speedup=true", f"eval.output_dir={tmp_path / 'eval'}", "eval.engine_max_model_len=1024",
    ])
    res = evaluate(cfg, ckpt)
    eng = res["engine"]
    assert eng["speculative_config"]["draft_sample_method"] == "greedy" and eng["protocol"] == "greedy drafts, T=1"
    assert eng["seeded"] is False  # vLLM's CPU build: a per-request seed would kill its worker
    cell = eng["tasks"]["gsm8k"]
    assert cell["same_protocol"] and cell["engine_drafts"] > 0 and cell["engine_draft_tokens"] == 3 * cell["engine_drafts"]
    assert cell["engine_tau"] is not None and 1.0 <= cell["engine_tau"] <= 4.0 and cell["ours_tau_at_S"] is not None
    assert abs(cell["relative_diff"]) < 0.05, cell
    report = (tmp_path / "eval" / "results.md").read_text()
    assert "Engine-backed" in report and "greedy drafts, T=1 on both sides" in report and "Served speedup" in report
    # served speedup: vLLM tokens/s with and without the draft, one request and 16 in flight, per benchmark
    served = eng["speedup"]
    for mode in ("single", "concurrent"):
        for task in ("gsm8k", "overall"):
            cell = served[task][mode]
            assert cell["spec_tokens_per_s"] > 0 and cell["baseline_tokens_per_s"] > 0 and cell["speedup"] > 0
    assert eng["timing"]["without_draft"]["gsm8k"]["single"]["tokens"] > 0
    assert eng["machine"] and eng["engine_version"]
    print("served", json.dumps({"speedup": served, "machine": eng["machine"]}))


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
