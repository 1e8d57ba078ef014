"""Every benchmark script's --smoke, run the way a user would: `benchmarks/run_all.py --smoke` runs each script in its
own process (two at a time, one thread each; forked from one that imported torch and transformers once) and collects
their JSON; each test below checks one script's figures for sense — counts that must come out exactly, rates that must
be positive, ratios that must agree with their parts. The forked runner itself, and run_all's --fresh path, are tested
at the end of this module.
(bench_cache, bench_train, bench_launches, bench_draft_memory and bench_gpu have tests of their own smokes.)"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["audit_cost", "copy", "draft_vllm_agreement", "drafts", "eval", "loader", "loss_normalization", "peer", "plan",
           "regenerate", "replay", "served_length", "step_time", "stream"]


@pytest.fixture(scope="module")
def smokes(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("smoke") / "smoke.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline",
               DEEPSPEC_NO_PROGRESS="1")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--smoke", "--jobs", "2", "--out", str(out),
                        "--only", *SCRIPTS], capture_output=True, text=True, env=env, timeout=900, cwd=str(ROOT))
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    data = json.loads(out.read_text())
    assert data["smoke"] and list(data["benchmarks"]) == SCRIPTS
    assert r.returncode == (1 if summary["failed"] else 0), r.stderr[-2000:]
    return data["benchmarks"]


def _result(smokes: dict, name: str) -> dict:
    entry = smokes[name]
    assert "error" not in entry, f"bench_{name}.py --smoke failed: {entry.get('error')}\n{entry.get('stderr_tail', '')}"
    res = entry["result"]
    assert res["smoke"] is True
    return res


def _rate(x) -> bool:
    return x is not None and 0.0 <= x <= 1.0


def check_audit_cost(r: dict) -> None:
    assert r["build_s"] > 0 and r["audit_s"] > 0 and set(r["audit_per_split"]) == {"train", "heldout"}
    assert all(split["ok"] and not split["failures"] and split["samples"] > 0 for split in r["audit_per_split"].values())
    assert math.isclose(r["audit_share_of_build"], r["audit_s"] / r["build_s"], rel_tol=0.01)


def check_copy(r: dict) -> None:
    assert r["samples"] == 4 and r["positions"] > 0 and _rate(r["loop_share"])
    for kind in ("loop", "fresh"):
        for name in ("draft_top1", "lookup_top1"):
            assert r[f"{kind}_{name}"] is None or _rate(r[f"{kind}_{name}"])


def check_replay(r: dict) -> None:
    s = r["replay_survival"]
    assert r["rows"] > 0 and len(s) == r["depth"] == r["val_depths"] == 3
    assert all(_rate(x) for x in s) and all(a >= b for a, b in zip(s, s[1:]))  # prefix survival cannot grow with depth
    assert math.isclose(r["replay_greedy_tau"], 1 + sum(s), abs_tol=1e-3)
    assert r["val_greedy_tau"] >= 1 and _rate(r["data_equals_target_argmax"])


def check_loader(r: dict) -> None:
    assert r["feature_bytes_per_token"] == (3 + 1) * 576 * 2  # SmolLM2: 3 taps + the final state, 576 wide, bf16
    assert set(r["by_workers"]) == {"0", "1"} and all(v > 0 for v in r["by_workers"].values())
    assert r["tokens_per_s"] == max(r["by_workers"].values())
    assert math.isclose(r["gb_per_s"], r["tokens_per_s"] * r["feature_bytes_per_token"] / 1e9, rel_tol=0.01, abs_tol=2e-3)
    assert r["memcpy_gb_per_s"] > 0 and "baseline" in r["not_run"] and "speedup" not in r


def check_plan(r: dict) -> None:
    assert r["conversations"] == r["samples"] == 50 and r["tokens"] > 50 * 20
    assert r["tokenize_s"] > 0 and r["load_s"] > 0 and r["plan_file_mb"] > 0
    assert math.isclose(r["conversations_per_s_tokenizing"], 50 / r["tokenize_s"], rel_tol=0.05)


def check_step_time(r: dict) -> None:
    assert (r["steps"], r["batch"], r["tokens"], r["threads"]) == (2, 1, 64, 1)
    assert r["median_step_s"] >= r["min_step_s"] > 0


def check_drafts(r: dict) -> None:
    algos = r["algorithms"]
    assert set(algos) == {"eagle3", "dflash", "dspark"} and r["seq_len"] == 32
    assert algos["eagle3"]["proposed_tokens"] == 3  # k tokens for a chain, block size - 1 for a block draft
    assert algos["dflash"]["proposed_tokens"] == algos["dspark"]["proposed_tokens"] == 6
    for row in algos.values():
        assert row["trainable_params"] > 1e6 and row["train_step_s"] > 0 and row["propose_s"] > 0


def check_eval(r: dict) -> None:
    match = r["greedy_outputs_match_target"]
    assert match["turns"] == 2 and match["matched_turns"] == 2  # greedy speculative decoding is lossless
    assert 0 < r["generated_tokens"] <= 2 * 16 and r["rounds"] > 0 and r["tau"] >= 1
    assert r["target_tokens_per_s"] > 0 and r["spec_tokens_per_s"] > 0
    assert math.isclose(r["speedup"], r["spec_tokens_per_s"] / r["target_tokens_per_s"], rel_tol=0.01)
    assert len(r["survival"]) == r["num_draft_tokens"] and all(_rate(x) for x in r["survival"])
    assert set(r["per_task_tau"]) == {"gsm8k"}


def check_regenerate(r: dict) -> None:
    assert r["engine"] == "hf" and r["prompts"] == 4 and "vLLM" in r["not_run"]
    assert 0 < r["output_tokens"] <= 4 * 8
    assert r["raw_output_tokens"] == r["output_tokens"]  # greedy, the same prompts: the same answers both ways
    assert r["tokens_per_s"] > 0 and r["raw_tokens_per_s"] > 0
    assert math.isclose(r["ratio"], r["tokens_per_s"] / r["raw_tokens_per_s"], rel_tol=0.01)


def check_served_length(r: dict) -> None:
    assert r["algorithm"] == "eagle3" and r["samples"] == 4 and r["skipped_too_long"] == 0
    assert {"config.json", "model.safetensors"} <= set(r["export_files"])
    assert r["spec_config"]["method"] == "eagle3" and r["by_max_tokens"] == {} and "vLLM" in r["not_run"]


def check_draft_vllm_agreement(r: dict) -> None:
    off = r["offline_fp32"]
    per = off["accepted_per_pos"]
    assert off["rounds"] > 0 and all(a >= b for a, b in zip(per, per[1:]))
    assert math.isclose(off["tau"], 1 + sum(per) / off["rounds"], abs_tol=1e-3)
    # trained on the very answers it then drafts: it must accept far more than an untrained draft's 1.0
    assert off["tau"] > 2 and r["train_metrics_last_step"]["top1@1"] > 0.9
    assert {"config.json", "model.safetensors"} <= set(r["export_files"]) and "vllm_bf16" not in r


def check_peer(r: dict) -> None:
    assert r["peer_input_rows"] == 8 and r["peer_input_tokens"] > 8 * 20 and r["budget_s"] > 0
    assert r["peer_epochs_for_budget"] >= 1 and r["prompts"]["samples"] == 4 and r["prompts"]["split"] == "heldout"
    assert {"config.json", "model.safetensors"} <= set(r["ours_export_files"]) and "peer" in r["not_run"]
    assert r["checkpoint"].endswith("step_2")


def check_loss_normalization(r: dict) -> None:
    runs = r["runs"]
    assert [(x["mode"], x["seed"]) for x in runs] == [("tokens", 0), ("positions", 0)]
    assert len({x["checkpoint"] for x in runs}) == 2 and all(x["checkpoint"].endswith("step_2") for x in runs)
    for x in runs:
        assert x["ours_tau"] >= 1 and x["val"]["step"] == 2 and x["train_s"] > 0 and x["vllm_tau"] is None
    assert "vLLM" in r["not_run"]


def check_stream(r: dict) -> None:
    off, st = r["offline"], r["stream"]
    assert off["steps"] == st["steps"] == 2 and st["produced"] == 8
    # the same samples in the same order: the streamed run's losses are the offline run's
    assert st["first_loss_rel_diff"] < 1e-3 and st["final_loss_rel_diff"] < 1e-3
    assert 0 < st["spool_peak_bytes"] <= st["spool_cap_bytes"]
    assert off["tokens_per_s"] > 0 and st["tokens_per_s"] > 0
    assert math.isclose(st["vs_offline"], st["tokens_per_s"] / off["tokens_per_s"], rel_tol=0.02, abs_tol=2e-3)
    assert _rate(st["trainer_wait_fraction"]) and _rate(st["producer_busy_fraction"])


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_smoke(smokes, name):
    globals()[f"check_{name}"](_result(smokes, name))


def test_every_listed_script_has_a_check_and_a_smoke_flag():
    for name in SCRIPTS:
        assert callable(globals().get(f"check_{name}")), name
        assert '"--smoke"' in (ROOT / "benchmarks" / f"bench_{name}.py").read_text(), name


def test_run_all_smoke_refuses_to_write_into_results():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--smoke", "--only", "plan", "--out",
                        str(ROOT / "benchmarks" / "results" / "smoke.json")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "benchmarks/results" in r.stderr
    assert not (ROOT / "benchmarks" / "results" / "smoke.json").exists()


FORKED_DRIVER = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import _forked
import torch
torch.set_num_threads(2)
scripts = {name: (__import__("pathlib").Path(sys.argv[2]) / f"{name}.py", [name, "--flag"]) for name in ("a", "b", "c")}
env = dict(os.environ, PROBE="child")
os.environ["PROBE"] = "parent"
res = _forked.run_forked(scripts, env, __import__("pathlib").Path(sys.argv[2]), 2,
                         lambda n, rc, out, err, s: {"rc": rc, "out": out, "err": err})
print(json.dumps({"parent_pid": os.getpid(), "parent_probe": os.environ["PROBE"], "parent_threads": torch.get_num_threads(),
                  "parent_marked": hasattr(json, "marked_by_a"), "results": res}))
"""

PROBE_SCRIPT = """
import json, os, sys
print(json.dumps({"name": __name__, "argv": sys.argv[1:], "cwd": os.getcwd(), "pid": os.getpid(), "probe": os.environ["PROBE"],
                  "torch_preloaded": "torch" in sys.modules, "threads": sys.modules["torch"].get_num_threads(),
                  "marked": hasattr(json, "marked_by_a"), "path0": sys.path[0]}))
"""


def test_forked_runner_gives_each_script_its_own_process_and_exit(tmp_path):
    """benchmarks/_forked.py: each script runs as __main__ in a process of its own, forked from the one that imported
    torch: its own argv, environment (OMP_NUM_THREADS sizes its torch pool), working folder, stdout, stderr and exit
    code; what one script changes (a module attribute) neither the parent nor the next script sees; a raised exception
    is a traceback on stderr and exit 1, sys.exit(3) is exit 3."""
    (tmp_path / "a.py").write_text(PROBE_SCRIPT + "json.marked_by_a = True\nprint('to stderr', file=sys.stderr)\n")
    (tmp_path / "b.py").write_text(PROBE_SCRIPT + "raise ValueError('b broke')\n")
    (tmp_path / "c.py").write_text(PROBE_SCRIPT + "sys.exit(3)\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", FORKED_DRIVER, str(ROOT / "benchmarks"), str(tmp_path)], capture_output=True,
                       text=True, timeout=120, env=env, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert (got["parent_probe"], got["parent_threads"], got["parent_marked"]) == ("parent", 2, False)
    res = got["results"]
    assert [res[n]["rc"] for n in "abc"] == [0, 1, 3]
    seen = {n: json.loads(res[n]["out"].strip().splitlines()[0]) for n in "abc"}
    for n, s in seen.items():
        assert s["name"] == "__main__" and s["argv"] == [n, "--flag"] and s["cwd"] == str(tmp_path), s
        assert s["probe"] == "child" and s["torch_preloaded"] and s["threads"] == 1 and not s["marked"], s
        assert s["path0"] == str(tmp_path) and s["pid"] != got["parent_pid"]
    assert len({s["pid"] for s in seen.values()}) == 3
    assert res["a"]["err"].strip() == "to stderr"
    assert "ValueError: b broke" in res["b"]["err"] and res["c"]["err"] == ""


@pytest.mark.slow  # its fixture runs every listed benchmark's smoke: ~100 s on 2 cores without AVX-512
def test_run_all_fresh_interpreters_collect_the_same(smokes, tmp_path):
    """`run_all.py --smoke --fresh`: the same script in a new interpreter gives the same figures' names."""
    out = tmp_path / "fresh.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--smoke", "--fresh", "--only", "plan",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=str(ROOT),
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    fresh = _result(json.loads(out.read_text())["benchmarks"], "plan")
    check_plan(fresh)
    assert set(fresh) == set(_result(smokes, "plan"))


def test_the_peer_gets_the_whole_epochs_nearest_our_time_or_those_asked_for():
    """bench_peer's peer trains whole epochs (its schedule decays over them): the number nearest our training time at
    its sizing rate, or --peer-epochs N to bracket the budget when none matches (2026-11-28: an epoch took 0.72x our
    time); its time limit grows with the epochs asked for."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_peer", ROOT / "benchmarks" / "bench_peer.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    per_epoch = 110_758 / bench.PEER_TOKENS_PER_S  # ~201 s at the sizing rate
    assert bench.peer_epochs(208.5, 110_758) == (1, pytest.approx(1.25 * 208.5 + 60))
    assert bench.peer_epochs(2.6 * per_epoch, 110_758)[0] == 3
    epochs, limit = bench.peer_epochs(208.5, 110_758, requested=2)
    assert epochs == 2 and limit == pytest.approx(1.25 * 208.5 * 2 + 60)
