"""`deepspec check`: exports of tiny random drafts agree with SGLang's own classes (run with SGLang's torch-native
attention backend) at every stage, and deliberately broken exports are caught at the stage their bug first shows,
with the cause named. All exports go through one SGLang process (export/check.py: check_exports)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepspec.export.writers import export_draft
from random_drafts import declare_calibration, drop_confidence_head, edit_export, random_draft_checkpoint, roll_confidence_head



def _ckpt(root: Path, family: str, algorithm: str, **fields) -> Path:
    return random_draft_checkpoint(root / "ckpt", family, algorithm, **fields)[1]


GOOD = {
    # EAGLE-3.1: embeddings + 3 layer taps, draft vocabulary, two layers, fc_norm and norm_output (bf16 export)
    "eagle31": ("llama", "eagle3", dict(target_layer_ids=[-1, 0, 2, 3], draft_vocab_size=100, num_draft_layers=2,
                                        fc_norm=True, norm_output=True)),
    # EAGLE-3 for a Qwen3 target with Llama-style layers, full vocabulary
    "eagle3": ("qwen3", "eagle3", dict(fc_norm=False, norm_output=False, qk_norm=False)),
    "dflash": ("qwen3", "dflash", dict(num_draft_layers=2, mask_token_id=259)),
    # DSpark with the RNN Markov head (its cell's columns are reordered for SGLang) and a confidence head
    "dspark-rnn": ("qwen3", "dspark", dict(num_draft_layers=2, mask_token_id=259, markov_head_type="rnn")),
}


def _drop_fc_norm(cfg):
    cfg["fc_norm"] = False


def _aux_plus_one(cfg):
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]


def _drop_fc_norm_weights(t):
    for k in [k for k in t if k.startswith("fc_norm.")]:
        t.pop(k)


def _shift_d2t(t):
    t["d2t"] = t["d2t"] + 1


def _flip_norm_output(cfg):
    cfg["norm_output"] = not cfg["norm_output"]


def _rope_theta_x4(cfg):
    cfg["rope_parameters"]["rope_theta"] *= 4
    cfg["rope_theta"] *= 4


def _causal_block(cfg):
    cfg["is_causal"] = True  # SGLang's DFlash layers then run as DECODER (causal) attention, not ENCODER_ONLY


def _rnn_columns_unswapped(t):
    """The RNN cell's weight in our column order [hidden, prev, state] instead of SGLang's [state, prev, hidden]."""
    w, r = t["markov_head.joint_proj.weight"], t["markov_head.markov_w1.weight"].shape[1]
    t["markov_head.joint_proj.weight"] = torch.cat([w[:, 2 * r :], w[:, r : 2 * r], w[:, :r]], dim=1)


def _wrong_mask(cfg):
    cfg["dflash_config"]["mask_token_id"] = cfg["dflash_config"]["mask_token_id"] - 1


# broken case -> (good export it starts from, config edit, tensor edit, first mismatch, words the cause must contain)
BROKEN = {
    "fc_norm dropped": ("eagle31", _drop_fc_norm, _drop_fc_norm_weights, "step1.fc", "fc_norm"),
    "aux ids + 1": ("eagle31", _aux_plus_one, None, "step1.taps", "eagle_aux_hidden_state_layer_ids"),
    "norm_output flipped": ("eagle31", _flip_norm_output, None, "step1.next_hidden", "norm_output"),
    "shifted d2t": ("eagle31", None, _shift_d2t, "step1.tokens", "d2t"),
    "wrong mask token": ("dflash", _wrong_mask, None, "block.input_ids", "mask_token_id"),
    "RoPE theta x4": ("eagle31", _rope_theta_x4, None, "step1.layer0", "rope_theta"),
    # SGLang's attention semantics are exercised: its causal flag changes the block's attention
    "causal DFlash block": ("dflash", _causal_block, None, "block.layer0", "is_causal"),
    "DSpark RNN cell columns unswapped": ("dspark-rnn", None, _rnn_columns_unswapped, "block.markov_logits", "markov"),
    # the confidence head SGLang's confidence-driven verify modes rank drafted slots by
    "DSpark confidence head rolled": ("dspark-rnn", None, roll_confidence_head, "block.confidence", "confidence_head"),
    "DSpark confidence head dropped": ("dspark-rnn", None, drop_confidence_head, "block.confidence", "confidence_head"),
    "DSpark calibration declared, not baked": ("dspark-rnn", declare_calibration, None, "block.confidence", "confidence_head"),
}


@pytest.fixture(scope="module")
def reports(sglang_side, tmp_path_factory):
    """Every good and broken export checked against SGLang's classes in one SGLang process."""
    import os

    from deepspec.export.check import check_exports

    os.environ["DEEPSPEC_SGLANG_SIDE"] = sglang_side
    root = tmp_path_factory.mktemp("check")
    exports = {}
    for case, (family, algorithm, fields) in GOOD.items():
        ckpt = _ckpt(root / case, family, algorithm, **fields)
        exports[case] = export_draft(ckpt, root / case / "sglang", "sglang", dtype="bfloat16" if case == "eagle31" else "float32")
    for case, (base, cfg_fn, t_fn, _, _) in BROKEN.items():
        exports[case] = edit_export(exports[base], root / case.replace(" ", "_"), cfg_fn, t_fn)
    out = check_exports(list(exports.values()), ("sglang",))
    return dict(zip(exports, out)), exports


@pytest.mark.slow
@pytest.mark.parametrize("case", list(GOOD))
def test_check_finds_no_divergence_in_sglang(case, reports):
    rep = reports[0][case]
    ec = rep.engines[0]
    print(rep.table())
    assert ec.status == "pass", rep.table()
    assert not rep.diverged
    stages = [r.stage for r in ec.rows]
    if case.startswith("eagle"):  # fc, every layer, norm, logits, tokens, next hidden, and chain step 2
        layers = 2 if case == "eagle31" else 1
        assert stages == ["step1.taps", "step1.fc", *[f"step1.layer{i}" for i in range(layers)], "step1.norm", "step1.logits",
                          "step1.tokens", "step1.next_hidden", "step2.input_token", *[f"step2.layer{i}" for i in range(layers)],
                          "step2.norm", "step2.logits", "step2.tokens"]
    else:
        assert stages == ["block.taps", "block.fc", "block.context", "block.input_ids", "block.layer0", "block.layer1",
                          "block.norm", "block.logits", *(["block.markov_logits"] if case == "dspark-rnn" else []),
                          "block.tokens", *(["block.confidence"] if case == "dspark-rnn" else [])]


@pytest.mark.parametrize("case", list(BROKEN))
def test_check_names_the_first_divergence_and_its_cause(case, reports):
    rep = reports[0][case]
    ec = rep.engines[0]
    _, _, _, stage, words = BROKEN[case]
    print(rep.table())
    assert rep.diverged and ec.status == "diverged"
    assert ec.first_mismatch == stage, rep.table()
    assert words in ec.cause, ec.cause
    assert all(r.ok for r in ec.rows[: [r.stage for r in ec.rows].index(stage)])  # everything before it agrees


def test_check_command_table_and_exit_code(reports, capsys):
    from deepspec import cli

    bad = reports[1]["wrong mask token"]
    assert cli.main(["check", str(bad), "--engine", "sglang"]) == 1  # in-process: reuses this process's SGLang worker
    out = capsys.readouterr().out
    assert "block.input_ids" in out and "FAIL" in out and "verdict: DIVERGES" in out and "mask_token_id" in out
    js = json.loads(json.dumps(reports[0]["dflash"].to_json()))  # what --json prints
    assert js["diverged"] is False and js["engines"][0]["status"] == "pass"
    assert reports[0]["dflash"].table().endswith("verdict: no divergence (sglang)")


def test_export_refuses_a_diverging_export_unless_skip_check(reports, tmp_path, monkeypatch, logs):
    """`deepspec export` checks before it writes: a writer bug (here: norm_output dropped from SGLang's config)
    leaves nothing behind and names the cause; --skip-check writes it with a warning."""
    from deepspec import cli
    from deepspec.export import sglang as sg

    ckpt = Path(json.loads((reports[1]["eagle31"] / "config.json").read_text())["deepspec"]["source_checkpoint"])
    real = sg.BUILDERS["eagle3"]

    def buggy(cfg, weights, draft, meta):
        out, w = real(cfg, weights, draft, meta)
        out["norm_output"] = False
        return out, w

    monkeypatch.setitem(sg.BUILDERS, "eagle3", buggy)
    out = tmp_path / "exp"
    assert cli.main(["export", str(ckpt), "--format", "sglang", "--out", str(out)]) == 2
    assert not out.exists() and not list(tmp_path.iterdir())
    assert "norm_output" in logs.text and "step1.next_hidden" in logs.text
    assert cli.main(["export", str(ckpt), "--format", "sglang", "--out", str(out), "--skip-check"]) == 0
    assert (out / "config.json").is_file() and "--skip-check" in logs.text and "NOT checked" in logs.text


def test_export_without_sglang_logs_the_skip_and_writes(tmp_path, monkeypatch, logs):
    from deepspec import cli

    monkeypatch.setenv("DEEPSPEC_SGLANG_SIDE", str(tmp_path / "nowhere"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    ckpt = _ckpt(tmp_path / "c", "qwen3", "dflash", num_draft_layers=1, mask_token_id=259)
    for fmt in ("sglang", "vllm"):
        out = tmp_path / f"out-{fmt}"
        assert cli.main(["export", str(ckpt), "--format", fmt, "--out", str(out), "--dtype", "float32"]) == 0
        assert (out / "model.safetensors").is_file()
    assert "SGLang's sources are not installed" in logs.text
    assert "export check skipped for vllm" in logs.text


def test_an_sglang_that_does_not_import_here_skips_the_check_and_the_export_is_written(tmp_path, monkeypatch, logs):
    """SGLang's side folder borrows its dependencies from this environment; where one is missing (no vLLM installed:
    pybase64, zmq, ...) SGLang's code cannot run at all. That is not a verdict on the export: the check is skipped
    with the missing module named, and `deepspec export` writes the export with that warning instead of refusing it
    as diverged. (Stand-in side folder: SGLang's first import needs a module that exists nowhere.)"""
    from deepspec import cli
    from deepspec.export.check import check_export

    side = tmp_path / "side"
    (side / "sglang" / "srt").mkdir(parents=True)
    (side / "sglang" / "test").mkdir(parents=True)
    for pkg in ("sglang", "sglang/srt", "sglang/test"):
        (side / pkg / "__init__.py").write_text("")
    (side / "sglang" / "test" / "layer_ut_utils.py").write_text("import deepspec_missing_dependency_xyz\n")
    (side / ".complete").write_text("")
    monkeypatch.setenv("DEEPSPEC_SGLANG_SIDE", str(side))
    ckpt = _ckpt(tmp_path / "c", "qwen3", "dflash", num_draft_layers=1, mask_token_id=259)
    export = export_draft(ckpt, tmp_path / "e", "sglang", dtype="float32")
    ec = check_export(export, ("sglang",)).engines[0]
    assert ec.status == "skipped" and "deepspec_missing_dependency_xyz" in ec.reason, (ec.status, ec.reason)
    assert "does not import in this environment" in ec.reason
    out = tmp_path / "out"
    assert cli.main(["export", str(ckpt), "--format", "sglang", "--out", str(out), "--dtype", "float32"]) == 0
    assert (out / "model.safetensors").is_file()
    assert "export check skipped for sglang" in logs.text and "deepspec_missing_dependency_xyz" in logs.text


def test_the_sglang_worker_sees_a_done_that_arrives_with_ready():
    """SGLang's worker answers READY, then DONE per job; a job that needs no work (a skipped check) answers at once, so
    both lines can reach the pipe together. One readline() then buffers both, and a select() on the pipe (how the
    worker used to wait) reports nothing more to read: the DONE sat unseen until the 600 s job timeout (a fresh-clone
    test run hung on it). MarkedLines reads with a thread and hands each marked line over as it comes."""
    import select
    import subprocess
    import sys
    import time

    from deepspec.export.check_sglang_runner import MarkedLines

    code = "import sys, time; sys.stdout.write('noise\\nREADY\\nDONE job0\\n'); sys.stdout.flush(); time.sleep(30)"

    def child():
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)

    old = child()  # the premise: after one readline, select() does not see the buffered lines
    time.sleep(1.0)
    assert old.stdout.readline() == "noise\n"
    assert select.select([old.stdout], [], [], 1.0)[0] == []
    old.kill()
    old.wait()

    proc = child()
    lines = MarkedLines(proc.stdout, ("READY", "DONE"))
    t0 = time.monotonic()
    assert lines.next(t0 + 10) == "READY" and lines.next(t0 + 10) == "DONE job0"
    assert time.monotonic() - t0 < 5
    assert lines.next(time.monotonic() + 0.2) is None  # nothing more: past the deadline
    proc.kill()
    proc.wait()
    assert lines.next(time.monotonic() + 10) is None  # the child ended


def test_the_confidence_tolerance_bounds_the_worst_input_difference_and_no_more():
    """check_reference.confidence_tolerance: sigmoid(w . [h; e] + c) moves by at most 1/4 sum|w_h| max|dh| (+ fp32
    rounding) when the final-norm rows h move by dh. The worst case, dh = d * sign(w_h) at z ~ 0, reaches the bound
    within the (worst-case, n u) rounding term; a random dh stays under it; one weight of the head 5% off moves it by more than 10x the rounding term."""
    from deepspec.export.check_reference import confidence_tolerance

    g = torch.Generator().manual_seed(0)
    hidden, rank = 64, 8
    w = torch.randn(1, hidden + rank, generator=g) * 0.3
    x = torch.randn(5, hidden + rank, generator=g)
    c = -(x @ w.T)[0:1, 0]  # z = 0 on the first row: the sigmoid's steepest point
    norm = torch.cat([torch.zeros(1, hidden), x[:, :hidden]])  # one anchor row before the drafted slots (first_slot = 1)
    tol_fn = confidence_tolerance(w, c, x, hidden, first_slot=1)

    def p(xx, ww=w):
        return torch.sigmoid(xx.double() @ ww.double().T + c.double())[:, 0]

    d = 1e-4
    worst = x.clone()
    worst[:, :hidden] += d * torch.sign(w[0, :hidden])
    tol = tol_fn({"block.norm": norm}, {"block.norm": torch.cat([norm[:1], worst[:, :hidden]])})
    moved = float((p(worst) - p(x)).abs().max())
    same = tol_fn({"block.norm": norm}, {"block.norm": norm.clone()})  # identical rows: fp32 rounding alone
    assert 0 < same < 1e-4 and moved <= tol <= 1.01 * moved + same, (moved, tol, same)
    noisy = x.clone()
    noisy[:, :hidden] += (torch.rand(5, hidden, generator=g) * 2 - 1) * d
    assert float((p(noisy) - p(x)).abs().max()) <= tol_fn({"block.norm": norm}, {"block.norm": torch.cat([norm[:1], noisy[:, :hidden]])})
    off = w.clone()
    off[0, 3] *= 1.05
    assert float((p(x, off) - p(x)).abs().max()) > 10 * same
    assert tol_fn({"block.norm": norm}, {"block.norm": norm[:3]}) == 0.0  # rows of another shape: no bound, the stage fails
