"""benchmarks/bench_launches.py --smoke: its JSON carries every figure, this tree's training step reads no device value
on the host (the loader's plan made outside the counted region), and the counters do catch reads — a planless call
of this tree's loss, and b3a919e's step when its worktree is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_launches.py"


def _bench():
    return load_script(SCRIPT)


@pytest.fixture(scope="module")
def smoke() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, env=env, timeout=600, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.slow
def test_smoke_reports_every_figure(smoke):
    assert set(smoke["rows"]) == {"dflash", "dspark", "eagle3"}
    keys = {"launches_per_micro_batch", "baseline_launches_per_micro_batch", "host_reads_in_step", "baseline_host_reads_in_step",
            "new_attention_shapes_per_step", "baseline_new_attention_shapes_per_step", "aten_ops_per_micro_batch",
            "flops_per_token_exact", "flops_per_token_bucketed", "top_ops"}
    for row in smoke["rows"].values():
        assert keys <= set(row)
        assert row["launches_per_micro_batch"] > 0 and row["flops_per_token_exact"] > 0
        if smoke["baseline"] is not None:
            assert row["baseline_launches_per_micro_batch"] > 0
            pred = row["predicted_h200"]["accum1"]
            assert pred["tokens_per_s"] > 0 and 0 < pred["mfu"] < 1
    assert smoke["self_check_passed"], smoke["self_check"]
    if smoke["baseline"] is not None:
        assert smoke["calibration"]["c_op_us"] > 0
        assert {"dflash", "eagle3", "passed"} <= set(smoke["calibration_check"])


@pytest.mark.slow
def test_this_tree_reads_nothing_in_the_step(smoke):
    for algo, row in smoke["rows"].items():
        assert row["host_reads_in_step"] == 0, algo
        assert row["dispatch_reads_in_step"] == 0, algo
    # a block draft's chunk shapes repeat from step to step (bucketed): nothing new after the first step
    assert smoke["rows"]["dflash"]["new_attention_shapes_per_step"] == 0


@pytest.mark.slow
def test_baseline_reads_are_caught(smoke):
    if smoke["baseline"] is None:
        pytest.skip("no b3a919e worktree: " + smoke.get("baseline_note", ""))
    assert smoke["rows"]["dflash"]["baseline_host_reads_in_step"] > 0  # its loss reads the drawn anchors (tolist)


def test_a_planless_step_reads_the_device(one_torch_thread):
    """This tree's loss without the loader's plan draws and plans its anchors itself: the counter sees those reads."""
    import torch

    from deepspec.data.batches import collate_features

    bench = _bench()
    OpCounter, HostReads = bench.make_modes()
    draft, cfg, tconf = bench._build(ROOT, "dflash", "smoke")
    target = bench.SHAPES["smoke"][0]
    sample = bench._sample(64, len(cfg.model.target_layer_ids), target["hidden_size"], target["vocab_size"], 0)
    batch = collate_features([sample])
    ops = OpCounter()
    with HostReads(ops) as reads, ops:
        loss, _ = draft.loss(batch)
        loss.backward()
    assert len(reads.reads) > 0 and ops.ops > 0
    batch.plan = draft.plan_batch(batch, key=1, buckets=True)
    with HostReads() as reads:
        loss, _ = draft.loss(batch)
        loss.backward()
    assert reads.reads == []
    assert torch.isfinite(loss)


def test_self_check_catches_every_read_kind():
    checks = _bench().self_check()
    assert all(checks.values()), {k: v for k, v in checks.items() if not v}
