"""Calibrated DSpark confidence (deepspec/eval/calibration.py): the per-position temperature fit, equal-mass ECE, the
replay of vLLM's draft-slot admission, the global scaling baked into the exported head, and a tiny trained DSpark
calibrated end to end."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from deepspec.eval.calibration import (Round, admit, calibration_report, ece, fit_logistic, fit_scaling, load_rounds, oracle_scores,
                                       pair_answers, pairs, replay_table, save_rounds, sigmoid, split_by_answer, write_calibration)


def _synthetic_rounds(n: int, k: int, a_true: list[float], b_true: list[float], seed: int = 0) -> list[Round]:
    """Rounds whose draft j is accepted (given the ones before it) with probability sigmoid(a_j z + b_j)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        z = rng.normal(1.0, 2.0, size=k)
        acc = 0
        while acc < k and rng.random() < sigmoid(a_true[acc] * z[acc] + b_true[acc]):
            acc += 1
        out.append(Round([float(v) for v in z], k, acc, answer=i % 40, temperature=0.0))
    return out


def test_fit_recovers_a_known_temperature_and_bias_per_position():
    """Golden: labels drawn from sigmoid(0.4 z + 0.3) at position 1 and sigmoid(0.25 z - 0.5) at position 2 (raw logits
    z overconfident by 2.5x and 4x); the NLL fit finds those (a, b); a position with too few pairs takes the global pair."""
    rng = np.random.default_rng(1)
    z = rng.normal(0.0, 3.0, size=40000)
    y = (rng.random(40000) < sigmoid(0.4 * z + 0.3)).astype(float)
    a, b = fit_logistic(z, y)
    assert a == pytest.approx(0.4, abs=0.02) and b == pytest.approx(0.3, abs=0.04)
    a_only, b_zero = fit_logistic(z, y, bias=False)
    assert b_zero == 0.0 and 0.3 < a_only < 0.45
    pos = np.repeat([0, 1], 20000)
    y2 = np.where(pos == 0, y, (rng.random(40000) < sigmoid(0.25 * z - 0.5)).astype(float))
    sc = fit_scaling(z, y2, pos, 3)
    assert sc.a[0] == pytest.approx(0.4, abs=0.03) and sc.b[0] == pytest.approx(0.3, abs=0.06)
    assert sc.a[1] == pytest.approx(0.25, abs=0.03) and sc.b[1] == pytest.approx(-0.5, abs=0.06)
    assert sc.fallback == [2] and (sc.a[2], sc.b[2]) == (sc.global_a, sc.global_b)


def test_ece_is_near_zero_when_calibrated_and_large_when_overconfident():
    rng = np.random.default_rng(2)
    p = rng.random(50000)
    y = (rng.random(50000) < p).astype(float)
    assert ece(p, y, 10) < 0.01
    over = sigmoid(3.0 * np.log(p / (1 - p)))  # the same outcomes, logits tripled
    assert ece(over, y, 10) > 0.08
    # by hand, two equal-mass bins: |0.15 - 0.5| / 2 + |0.85 - 1| / 2
    assert ece(np.array([0.9, 0.1, 0.8, 0.2]), np.array([1.0, 0.0, 1.0, 1.0]), 2) == pytest.approx(0.25)


def test_admission_replay_equals_brute_force_enumeration():
    """vLLM's rule (global top-k of survival products within capacity) is the allocation that maximises the summed
    survival of the admitted slots; every allocation of a small batch is enumerated and compared."""
    rng = np.random.default_rng(3)
    for trial in range(30):
        n, k = int(rng.integers(2, 4)), int(rng.integers(2, 5))
        probs = rng.random((n, k)).tolist()
        caps = [int(c) for c in rng.integers(1, k + 1, size=n)]
        budget = int(rng.integers(0, sum(caps) + 2))
        got = admit(probs, caps, budget)
        surv = [np.cumprod(row) for row in probs]

        def value(alloc):
            return sum(surv[r][:m].sum() for r, m in enumerate(alloc))

        best = max((al for al in itertools.product(*[range(c + 1) for c in caps]) if sum(al) == min(budget, sum(caps))), key=value)
        assert sum(got) == min(budget, sum(caps)) and all(0 <= g <= c for g, c in zip(got, caps)), (trial, got)
        assert list(got) == list(best), (trial, probs, caps, budget)


def test_replay_table_counts_accepted_prefixes_and_the_oracle_bounds_every_scoring():
    rounds = [Round([0.0, 0.0, 0.0], 3, 2, 0), Round([0.0, 0.0, 0.0], 3, 0, 1)]
    # raw: request 0 looks hopeless, request 1 certain -> a budget of 2 goes to request 1, which accepts nothing
    scores = {"bad": [[0.1, 0.1, 0.1], [0.9, 0.9, 0.9]], "oracle": oracle_scores(rounds)}
    row = replay_table(rounds, scores, batch_size=2, budgets_per_request=[1.0])[0]
    assert row["bad"]["verified_slots"] == 2 and row["bad"]["accepted_per_verified_slot"] == 0.0
    assert row["oracle"]["accepted_per_verified_slot"] == 1.0 and row["oracle"]["accepted_per_request"] == 1.0
    many = _synthetic_rounds(400, 4, [0.5] * 4, [0.5] * 4)
    raw = [list(sigmoid(np.asarray(r.logits))) for r in many]
    table = replay_table(many, {"raw": raw, "oracle": oracle_scores(many)}, batch_size=8, budgets_per_request=[1, 2, 4])
    for row in table:
        assert row["oracle"]["accepted_per_verified_slot"] >= row["raw"]["accepted_per_verified_slot"]
    assert table[-1]["raw"] == table[-1]["oracle"]  # a budget covering every slot admits them all


def test_calibration_lowers_ece_on_a_held_out_split_and_pairs_follow_conditional_acceptance():
    rounds = _synthetic_rounds(12000, 3, [0.4, 0.3, 0.2], [0.0, -0.3, -0.6])
    z, y, pos = pairs(rounds[:1])
    assert len(z) == min(3, rounds[0].accepted + 1) and y.tolist() == [1.0] * rounds[0].accepted + [0.0] * (len(z) - rounds[0].accepted)
    rep = calibration_report(rounds, bins=10)
    t = rep["temperatures"]["0"]
    assert rep["binning"] == "equal-mass" and rep["bins"] == 10
    for raw, cal in zip(t["ece_raw"], t["ece_calibrated"]):
        assert raw > 0.1 and cal < 0.05
    assert t["scaling"]["a"][0] == pytest.approx(0.4, abs=0.08)


def _draft_ckpt(tmp_path):
    from deepspec.config.model import ModelConfig
    from deepspec.drafts import get_algorithm
    from deepspec.drafts.checkpoint import save_draft
    from deepspec.targets import tiny_config

    cfg = ModelConfig(algorithm="dspark", block_size=4, markov_rank=8, target_layer_ids=[0, 2, 3], mask_token_id=259)
    draft = get_algorithm("dspark").from_target_config(tiny_config("qwen3"), cfg)
    with torch.no_grad():
        draft.confidence_head.proj.weight.normal_(0, 0.5)
        draft.confidence_head.proj.bias.fill_(0.7)
    prov = {"target": "tiny-qwen3", "target_vocab_size": 320, "target_hidden_size": 64, "target_num_layers": 6}
    return draft, save_draft(draft, tmp_path / "ckpt", prov)


@pytest.fixture(scope="module")
def baked(tmp_path_factory):
    """A DSpark checkpoint exported with a synthetic calibration.json (global pair ~ (0.4, 0.2)) baked in."""
    from deepspec.export.writers import export_draft

    tmp = tmp_path_factory.mktemp("baked")
    draft, ckpt = _draft_ckpt(tmp)
    rep = calibration_report(_synthetic_rounds(2000, 3, [0.4] * 3, [0.2] * 3), bins=10)
    write_calibration(rep, tmp / "cal")
    out = export_draft(ckpt, tmp / "out", "vllm", calibration=tmp / "cal" / "calibration.json")
    cal = json.loads((tmp / "cal" / "calibration.json").read_text())
    return draft, out, cal


def test_the_export_bakes_the_global_scaling_and_records_the_per_position_fit(baked):
    """The exported head computes sigmoid(a z + b) of the trained head's logit z, with (a, b) the calibration's global
    pair; the per-position pairs, which the shared head cannot carry, are in config.json and the model card."""
    from deepspec.drafts.dspark import ConfidenceHead

    draft, out, cal = baked
    a, b = cal["bake"]["a"], cal["bake"]["b"]
    assert a == pytest.approx(0.4, abs=0.08) and cal["bake"]["temperature"] == 0.0
    w = load_file(str(out / "model.safetensors"))
    head = ConfidenceHead(64, 8, True)
    head.load_state_dict({"proj.weight": w["confidence_head.proj.weight"], "proj.bias": w["confidence_head.proj.bias"]})
    assert w["confidence_head.proj.weight"].dtype == torch.float32
    x, e = torch.randn(16, 64), torch.randn(16, 8)
    with torch.no_grad():
        z = draft.confidence_head(x, e)
        assert torch.allclose(torch.sigmoid(head(x, e)), torch.from_numpy(sigmoid(a * z.double().numpy() + b)).float(), atol=1e-6)
    rec = json.loads((out / "config.json").read_text())["deepspec"]["confidence_calibration"]
    assert rec["baked"] == {"a": a, "b": b, "temperature": 0.0}
    assert rec["per_position_not_baked"]["a"] == cal["temperatures"]["0"]["scaling"]["a"]
    assert rec["method"] == cal["temperatures"]["0"]["scaling"]["method"]
    card = (out / "README.md").read_text()
    assert "## Confidence calibration" in card and f"sigmoid({a:.4f}·z {b:+.4f})" in card and "exported as trained" not in card


def test_a_calibration_that_kept_the_raw_head_says_so_in_the_model_card():
    """Cross-validation kept the raw head (baked pair (1, 0)): the card says the head is exported as trained and names
    the pair that did not beat it, instead of printing an identity scaling as if it were a calibration."""
    from deepspec.export.writers import calibration_card

    rec = {"baked": {"a": 1.0, "b": 0.0, "temperature": 0.0}, "method": "identity", "global_fit": [0.93, -0.11],
           "per_position_not_baked": {"a": [1.0, 1.0], "b": [0.0, 0.0]}, "ece_bins": 10, "ece_raw": [0.02, 0.03],
           "ece_global_only": [0.02, 0.03], "ece_per_position_calibrated": [0.02, 0.03]}
    card = calibration_card(rec)
    assert "exported as trained" in card and "sigmoid(0.9300·z -0.1100)" in card and "sigmoid(1.0000" not in card
    assert "identity" in card


def test_a_file_that_is_not_a_calibration_is_refused(tmp_path):
    from deepspec.errors import ConfigError
    from deepspec.export.writers import export_draft

    _, ckpt = _draft_ckpt(tmp_path)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a calibration.json"):
        export_draft(ckpt, tmp_path / "out", "vllm", calibration=tmp_path / "bad.json")


VLLM_HEAD = """
import json, sys, torch
from safetensors.torch import load_file
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.qwen3_dspark import DSparkConfidenceHead
export, port = sys.argv[1], sys.argv[2]
w = load_file(export + "/model.safetensors")
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:" + port, local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)
    head = DSparkConfidenceHead(72, prefix="confidence_head", bias=True, with_markov=True)
for name, p in head.named_parameters():
    getattr(p, "weight_loader", lambda q, t: q.data.copy_(t))(p, w["confidence_head." + name])
head.proj.quant_method.process_weights_after_loading(head.proj)
g = torch.Generator().manual_seed(0)
x, e = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
with torch.no_grad():
    print(json.dumps(torch.sigmoid(head(x, e)).tolist()))  # Qwen3DSparkForCausalLM.compute_confidence
"""


@pytest.mark.slow
def test_vllms_confidence_head_computes_the_calibrated_values_from_the_export(baked, tmp_path):
    """vLLM's own DSparkConfidenceHead (qwen3_dspark.py), loaded from the baked export in a fresh process, returns
    sigmoid(a z + b) of our trained head's logit: what adaptive verification ranks is the calibrated confidence."""
    pytest.importorskip("vllm")
    import socket

    draft, out, cal = baked
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = subprocess.run([sys.executable, "-c", VLLM_HEAD, str(out), str(port)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = torch.tensor(json.loads(res.stdout.strip().splitlines()[-1]))
    g = torch.Generator().manual_seed(0)
    x, e = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
    with torch.no_grad():
        z = draft.confidence_head(x, e).double().numpy()
    want = torch.from_numpy(sigmoid(cal["bake"]["a"] * z + cal["bake"]["b"])).float()
    assert torch.allclose(got, want, atol=1e-5), (got, want)
    assert not torch.allclose(got, torch.from_numpy(sigmoid(z)).float(), atol=1e-3)  # the raw head would differ


def _bench():
    from script_loader import load_script

    return load_script("benchmarks/bench_calibration.py")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """bench_calibration's smoke checkpoint: a DSpark trained 4 steps on a tiny Qwen3 target (the shared tiny recipe),
    and the eval overrides for its six prompts."""
    root = tmp_path_factory.mktemp("dspark-cal")
    ckpt, opts = _bench().smoke_checkpoint(root)
    return root, ckpt, opts


@pytest.mark.slow
def test_a_trained_dspark_is_calibrated_end_to_end(trained, one_torch_thread):
    """The evaluator's own decoding at T = 0 and T = 1 gives (logit, outcome) pairs, the report has per-position ECE
    before / after and the admission replay; calibration.json + calibration.png are written; the export bakes it."""
    from deepspec.config import load_config
    from deepspec.eval.calibration import calibrate
    from deepspec.export.writers import export_draft

    root, ckpt, opts = trained
    ecfg = load_config(str(ckpt / "config.yaml"), opts + ["logging.wandb=false"])
    out = root / "eval"
    rep = calibrate(ecfg, ckpt, out, temperatures=(0.0, 1.0), bins=5, batch_size=4, budgets_per_request=(1.0, 2.0, 3.0))
    assert (out / "calibration.png").stat().st_size > 1000 and (out / "calibration.json").is_file()
    assert set(rep["temperatures"]) == {"0", "1"} and rep["bins"] == 5
    for t in rep["temperatures"].values():
        assert t["rounds"]["fit"] > 0 and t["rounds"]["eval"] > 0
        assert len(t["ece_raw"]) == 3 and len(t["scaling"]["a"]) == 3
        assert t["pairs_per_position"]["eval"][0] == t["rounds"]["eval"]  # every round reaches its first draft
        assert all(v is None or 0.0 <= v <= 1.0 for v in t["ece_raw"] + t["ece_calibrated"])
        for row in t["admission_replay"]["rows"]:
            assert row["oracle"]["accepted_per_request"] >= max(row[s]["accepted_per_request"] for s in ("raw", "calibrated"))
    exp = export_draft(ckpt, root / "export", "vllm", calibration=out / "calibration.json")
    assert json.loads((exp / "config.json").read_text())["deepspec"]["confidence_calibration"]["baked"]["temperature"] == 1.0


@pytest.mark.slow
def test_the_calibration_benchmark_prints_ece_and_the_replay_table(trained, one_torch_thread, tmp_path, capsys):
    """benchmarks/bench_calibration.py on the smoke checkpoint: its JSON has per-position ECE before / after and the
    replay table at each budget for raw, calibrated and oracle scores."""
    _, ckpt, opts = trained
    assert _bench().main(["--checkpoint", str(ckpt), "--opts", *opts, "--budgets", "1,3", "--out", str(tmp_path / "b.json")]) == 0
    res = json.loads((tmp_path / "b.json").read_text())
    assert json.loads(capsys.readouterr().out) == res and res["mode"] == "checkpoint" and res["smoke"] is False and res["bins"] == 10
    t = res["temperatures"]["1"]
    assert len(t["ece_raw"]) == len(t["ece_calibrated"]) == 3 and res["files"]["png_written"]
    rows = t["admission_replay"]["rows"]
    assert [r["budget_per_request"] for r in rows] == [1.0, 3.0]
    assert all({"raw", "calibrated", "global_only", "oracle"} <= set(r) for r in rows)


def test_a_fit_without_signal_keeps_the_ranking_it_cannot_improve():
    """Labels without a usable signal must not flip the head's ranking: one class only gives a ~ 0 and the bias of
    (nearly) that class; anti-correlated labels, where the free fit takes a < 0, give a = 0 and the acceptance rate."""
    z = np.linspace(-3, 3, 200)
    a, b = fit_logistic(z, np.zeros(200))
    assert 0.0 <= a < 0.1 and sigmoid(b) < 0.01
    y = (z < 0).astype(float)  # anti-correlated: the free fit would take a < 0
    a, b = fit_logistic(z, y)
    assert a == 0.0 and sigmoid(b) == pytest.approx(0.5, abs=0.01)


def _answer_rounds(n_answers: int, per_answer: int, k: int, a_true: float, b_true: float, answer_sd: float = 0.0,
                   seed: int = 0) -> list[Round]:
    """Rounds grouped in answers: draft j accepted (given the ones before) with probability sigmoid(a z + b + u), u an
    answer's own offset (sd `answer_sd`), as greedy answers differ in how predictable they are."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_answers):
        u = rng.normal(0.0, answer_sd)
        for _ in range(per_answer):
            z = rng.normal(-1.0, 1.5, size=k)
            acc = 0
            while acc < k and rng.random() < sigmoid(a_true * z[acc] + b_true + u):
                acc += 1
            out.append(Round([float(v) for v in z], k, acc, g, 0.0))
    return out


def _nll(p, y):
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return float(np.mean(-(y * np.log(p) + (1 - y) * np.log(1 - p))))


def test_a_head_that_is_already_calibrated_is_left_as_it_is():
    """Labels drawn from sigmoid(z) itself: cross-validation over the fit split's answers keeps the raw head (method
    identity, baked pair (1, 0)), so the calibrated scores are the raw ones and nothing can get worse."""
    for seed in range(5):
        fit, ev = split_by_answer(_answer_rounds(40, 100, 4, 1.0, 0.0, seed=seed))
        z, y, pos = pairs(fit)
        sc = fit_scaling(z, y, pos, 4, answers=pair_answers(fit))
        assert sc.method == "identity" and (sc.global_a, sc.global_b) == (1.0, 0.0), (seed, sc)
        assert sc.cv_answers == 20 and set(sc.cv_nll) == {"identity", "global", "per_position@1000", "per_position@100", "per_position@10"}
        ze, _, pe = pairs(ev)
        assert np.array_equal(sc.apply(ze, pe), sigmoid(ze))


def test_a_position_with_few_pairs_stays_near_the_global_pair_and_does_not_get_worse():
    """Every position overconfident the same way (truth sigmoid(0.5 z - 0.5)); the deepest reaches ~30 pairs. Fitted
    alone, that position's pair wanders (a = 0 or 0.84 on these seeds); chosen by cross-validation it keeps the global
    pair, closer to the truth on every seed, and its held-out NLL is below the raw head's."""
    for seed in range(5):
        fit, ev = split_by_answer(_answer_rounds(40, 60, 4, 0.5, -0.5, seed=seed))
        z, y, pos = pairs(fit)
        sc = fit_scaling(z, y, pos, 4, answers=pair_answers(fit))
        m = pos == 3
        assert 15 < m.sum() < 60, m.sum()
        alone = fit_logistic(z[m], y[m])
        assert np.hypot(sc.a[3] - 0.5, sc.b[3] + 0.5) < np.hypot(alone[0] - 0.5, alone[1] + 0.5), (seed, sc.a[3], sc.b[3], alone)
        ze, ye, pe = pairs(ev)
        me = pe == 3
        assert _nll(sc.apply(ze[me], pe[me]), ye[me]) < _nll(sigmoid(ze[me]), ye[me]), seed


def test_answers_not_rounds_are_the_unit_of_the_selection():
    """Answers with their own acceptance offsets (sd 1 in logit units) and a head right apart from them: held-out
    answers, not held-out rounds, decide. Pair-level folds take the most flexible per-position fit on every seed;
    answer-level folds take a simpler one or the same, and their held-out NLL over the seeds is no worse."""
    order = ["identity", "global", "per_position@1000", "per_position@100", "per_position@10"]
    grouped, pairwise = [], []
    for seed in range(5):
        fit, ev = split_by_answer(_answer_rounds(40, 150, 4, 1.0, 0.0, answer_sd=1.0, seed=seed))
        z, y, pos = pairs(fit)
        by_answer, by_pair = fit_scaling(z, y, pos, 4, answers=pair_answers(fit)), fit_scaling(z, y, pos, 4)
        name = lambda sc: sc.method if sc.shrinkage is None else f"per_position@{sc.shrinkage:g}"  # noqa: E731
        assert name(by_pair) == "per_position@10" and order.index(name(by_answer)) <= order.index(name(by_pair))
        ze, ye, pe = pairs(ev)
        grouped.append(_nll(by_answer.apply(ze, pe), ye))
        pairwise.append(_nll(by_pair.apply(ze, pe), ye))
    assert sum(grouped) <= sum(pairwise), (grouped, pairwise)


def test_rounds_are_saved_and_a_refit_reads_them_back(tmp_path):
    rounds = _synthetic_rounds(50, 3, [0.5] * 3, [0.0] * 3)
    path = save_rounds(rounds, tmp_path / "calibration_rounds.jsonl")
    assert load_rounds(path) == rounds
    (tmp_path / "bad.jsonl").write_text("{\"logits\": 1}\n")
    from deepspec.errors import ConfigError

    with pytest.raises(ConfigError, match="not a calibration_rounds.jsonl"):
        load_rounds(tmp_path / "bad.jsonl")


@pytest.mark.slow
def test_a_killed_collection_resumes_where_it_stopped_and_refuses_other_settings(trained, one_torch_thread, tmp_path, monkeypatch):
    """Rounds reach disk answer by answer: a collection cut after two answers, rerun on the same file, decodes only the
    ones it lacks and ends with exactly the rounds of an uncut run; the same file under other decode settings is refused."""
    import deepspec.eval.decode as decode
    from deepspec.config import load_config
    from deepspec.errors import ConfigError
    from deepspec.eval.calibration import collect_rounds

    _, ckpt, opts = trained
    cfg = load_config(str(ckpt / "config.yaml"), opts + ["logging.wandb=false"])
    whole = collect_rounds(cfg, ckpt, temperatures=(0.0,), rounds_path=tmp_path / "whole.jsonl")
    n = len({r.answer for r in whole})
    assert n > 2 and sorted({r.answer for r in whole}) == list(range(n))
    assert load_rounds(tmp_path / "whole.jsonl") == whole

    path = tmp_path / "cut.jsonl"
    real, calls = decode.generate_speculative, []

    def stop_after_two(*a, **k):
        if len(calls) == 2:
            raise KeyboardInterrupt  # the kill, between two answers' decodes
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(decode, "generate_speculative", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        collect_rounds(cfg, ckpt, temperatures=(0.0,), rounds_path=path)
    assert {r.answer for r in load_rounds(path)} == {0, 1}
    calls.clear()
    monkeypatch.setattr(decode, "generate_speculative", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    assert collect_rounds(cfg, ckpt, temperatures=(0.0,), rounds_path=path) == whole and len(calls) == n - 2
    other = load_config(str(ckpt / "config.yaml"), opts + ["logging.wandb=false", "eval.max_new_tokens=8"])
    with pytest.raises(ConfigError, match="other settings"):
        collect_rounds(other, ckpt, temperatures=(0.0,), rounds_path=path)


def test_the_baked_pair_is_the_one_fitted_at_the_temperature_asked_for(tmp_path):
    """Heads are calibrated per temperature (on the quickstart's DSpark the two fits point opposite ways), so the pair an
    export bakes is chosen: by default the highest temperature measured, else `--bake-temperature`; a temperature that
    was not measured is refused."""
    import dataclasses

    from deepspec.errors import ConfigError
    from deepspec.eval.calibration import calibrate, main

    cold = _synthetic_rounds(2000, 3, [0.4] * 3, [0.2] * 3)
    hot = [dataclasses.replace(r, temperature=1.0) for r in _synthetic_rounds(2000, 3, [0.25] * 3, [-0.5] * 3, seed=1)]
    both = cold + hot
    default = calibrate(None, None, tmp_path / "default", rounds=both)
    assert default["bake"]["temperature"] == 1.0
    assert (default["bake"]["a"], default["bake"]["b"]) == (default["temperatures"]["1"]["scaling"]["global_a"],
                                                            default["temperatures"]["1"]["scaling"]["global_b"])
    # each temperature's pair is also priced on the other's evaluation split (a head baked at T = 1 served at T = 0)
    for t, other in (("0", "1"), ("1", "0")):
        cross, own = default["temperatures"][t]["with_pair_of"][other], default["temperatures"][t]
        assert cross["pair"] == [default["temperatures"][other]["scaling"]["global_a"], default["temperatures"][other]["scaling"]["global_b"]]
        assert [r["raw"] for r in cross["accepted_per_verified_slot"]] == [r["raw"]["accepted_per_verified_slot"] for r in own["admission_replay"]["rows"]]
        assert cross["ece_all_positions"] > own["ece_all_positions"]["global_only"]  # the other temperature's pair fits worse
        assert own["ece_global_fit"] == own["ece_global_only"] and own["scaling"]["method"] != "identity"
    cold_bake = calibrate(None, None, tmp_path / "cold", rounds=both, bake_temperature=0.0)["bake"]
    assert cold_bake["temperature"] == 0.0 and cold_bake["a"] == pytest.approx(0.4, abs=0.08) and default["bake"]["a"] == pytest.approx(0.25, abs=0.08)
    with pytest.raises(ConfigError, match="No calibration at temperature 0.5"):
        calibrate(None, None, tmp_path / "none", rounds=both, bake_temperature=0.5)
    # the command line: a refit from saved rounds, baked at T = 0
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.yaml").write_text("project: cal\n")
    save_rounds(both, tmp_path / "rounds.jsonl")
    main([str(ckpt), "--out", str(tmp_path / "cli"), "--rounds", str(tmp_path / "rounds.jsonl"), "--bake-temperature", "0"])
    assert json.loads((tmp_path / "cli" / "calibration.json").read_text())["bake"] == cold_bake
