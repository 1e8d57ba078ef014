"""A reduced quickstart (the recipe `scripts/quickstart.sh` runs), end to end on the embedded SmolLM2 target with
the real vLLM engine: blended prompts -> regenerate (in-process vLLM) -> cache -> train EAGLE-3.1 -> eval (ours, on
the general held-out split) -> export -> vLLM serving the export. Asserts every stage's artifact, and that vLLM
accepted draft tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[1]
RECIPE = "config/quickstart/eagle3_blend.yaml"  # what scripts/quickstart.sh runs
PROJECT = "quickstart-blend"


def _bench(script: str, *argv: str, capsys, monkeypatch) -> dict:
    """benchmarks/SCRIPT.py ARGV run by its own main() in this process (its argument parsing, its JSON line): the
    figures it prints last (a fresh interpreter per script cost its start and imports three times)."""
    from script_loader import load_script

    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    capsys.readouterr()
    code = load_script(f"benchmarks/{script}.py").main()
    out = capsys.readouterr().out
    assert code == 0, out[-4000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.timeout(1500)
def test_reduced_quickstart(tmp_path, smollm2_dir, capsys, monkeypatch):
    pytest.importorskip("vllm")
    out, ckpts = tmp_path / "outputs", tmp_path / "checkpoints"
    opts = [
        f"output_root={out}", f"train.output_root={ckpts}",
        "data.prompts.max_samples=40", "data.prompts.heldout=4", "data.regenerate.sampling.max_tokens=64",
        "cache.max_length=256", "train.max_steps=30", "train.val_every=15", "train.save_every=15",
        "eval.tasks=[heldout:general]", "eval.task_max_samples={}", "eval.max_samples=3", "eval.max_new_tokens=48",
        "eval.num_workers=1",
        # the served speedup on 2 prompts x 32 tokens (the recipe: 16 x 128): the same code, a quarter of the timing
        "eval.engine_speedup_max_samples=2", "eval.engine_speedup_max_new_tokens=32",
    ]
    env = dict(os.environ, DEEPSPEC_NO_PROGRESS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "deepspec.cli", "run", RECIPE, "--opts", *opts]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stderr[-4000:]

    data = out / PROJECT / "data"
    for name in ("conversations.jsonl", "heldout.jsonl", "regenerated.jsonl", "regenerated.heldout.jsonl"):
        assert (data / name).is_file() and (data / name).stat().st_size > 0, name
    ids = [json.loads(line)["id"] for line in (data / "regenerated.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) > 0
    # the blend: per-source counts in the summary, and held-out splits drawn from sources training never sees
    entries = json.loads((data / "prompts_summary.json").read_text())["source"]["entries"]
    taken = {e["name"]: e["taken"] for e in entries}
    assert all(taken[name] > 0 for name in ("chat", "instructions", "tool-calls")), taken

    def parts(split: str) -> set[tuple[str, str | None]]:  # (source, subset) pairs of a split's entries
        return {(e["source"], sub) for e in entries if e["split"] == split for sub in (e["subset"] or [None])}

    assert not parts("general") & parts("train") and not parts("agentic") & parts("train")
    for split in ("general", "agentic"):
        assert len((data / f"heldout.{split}.jsonl").read_text().splitlines()) > 0
    for split in ("train", "heldout"):
        manifest = json.loads((out / PROJECT / "cache" / split / "manifest.json").read_text())
        assert manifest["taps"] == [-1, 1, 14, 26]  # the embeddings feed the copy heads' keys
    (run_dir,) = (ckpts / PROJECT).glob("eagle3*")
    assert run_dir.name == "eagle3"  # overrides are recorded in the run's config.yaml, not in its folder name
    step = run_dir / "step_30"
    assert (step / "model.safetensors").is_file() and (step / "config.json").is_file()
    assert (run_dir / "step_latest").exists()
    eval_dir = step / "eval"
    results = json.loads((eval_dir / "results.json").read_text())
    assert (eval_dir / "results.md").is_file() and (eval_dir / "acceptance.png").stat().st_size > 1000
    assert results["overall"]["rounds"] > 0 and results["overall"]["tau"] >= 1.0
    assert list(results["tasks"]) == ["heldout:general"]
    engine = results["engine"]["overall"]
    assert engine["engine_drafts"] > 0
    # the served speedup (vLLM tokens/s with and without the draft, one request and 16 in flight) on the headline split
    served = results["engine"]["speedup"]
    assert results["engine"]["timing"]["max_new_tokens"] == 32, results["engine"]["timing"]
    for mode in ("single", "concurrent"):
        cell = served["heldout:general"][mode]
        assert cell["spec_tokens_per_s"] > 0 and cell["baseline_tokens_per_s"] > 0 and cell["speedup"] > 0, served
    assert "Served speedup" in (eval_dir / "results.md").read_text() and results["engine"]["machine"]
    assert engine["engine_accepted_tokens"] > 0, engine  # vLLM accepted tokens of our exported draft
    export = eval_dir / "export-vllm" / "config.json"  # engine-backed eval exports next to its results
    assert json.loads(export.read_text())["eagle_aux_hidden_state_layer_ids"] == [0, 2, 15, 27]
    # ... and checks it against vLLM's own class before serving it (SmolLM2's 64-wide heads run on vLLM's CPU kernels)
    assert results["engine"]["export_check"]["status"] == "pass", results["engine"]["export_check"]
    summary = (out / PROJECT / "summary.md").read_text()
    assert "eagle3" in summary and "vLLM tau" in summary
    assert "served by vLLM: mean acceptance length per benchmark" in summary  # the held-out figure, not only overall

    # decoding sees what validation measured: the proposer replaying the held-out cache gets the
    # validation greedy tau (bf16 rounding aside) — an alignment slip between the two would split them
    heldout = str(out / PROJECT / "cache" / "heldout")
    figures = _bench("bench_replay", str(step), "--cache", heldout, capsys=capsys, monkeypatch=monkeypatch)
    assert figures["rows"] > 50 and figures["depth"] == figures["val_depths"] == 3
    assert abs(figures["replay_greedy_tau"] - figures["val_greedy_tau"]) < 0.02, figures

    # the copy benchmark runs on the same checkpoint, trained and with the copy heads alone (model.init_copy_heads)
    for extra in ([], ["--reinit-copy-heads"]):
        figures = _bench("bench_copy", str(step), "--cache", heldout, *extra, capsys=capsys, monkeypatch=monkeypatch)
        assert figures["positions"] > 50 and figures["untrained_copy_heads"] == bool(extra)
        if figures["loop_share"] > 0:  # a loop position is one the lookup gets right on the data
            assert figures["loop_lookup_top1"] >= 0.9, figures
