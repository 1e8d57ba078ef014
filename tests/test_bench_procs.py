"""Benchmarks survive hangs: a measurement past its time is killed with its whole process tree (a grandchild in a
session of its own included, as torchrun starts its workers), and bench_gpu.py writes each row as it finishes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _procs import GroupTimeout, run_group  # noqa: E402


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_timeout_kills_the_whole_tree(tmp_path):
    pids = tmp_path / "pids"
    script = (
        "import os, subprocess, sys, time\n"
        "a = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"  # same group
        "b = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        f"open({str(pids)!r}, 'w').write(f'{{a.pid}} {{b.pid}}')\n"
        "print('started', flush=True)\n"
        "time.sleep(120)\n"
    )
    t0 = time.monotonic()
    with pytest.raises(GroupTimeout) as e:
        run_group([sys.executable, "-c", script], timeout=3, grace_s=1)
    assert time.monotonic() - t0 < 30
    assert "started" in e.value.stdout
    for pid in map(int, pids.read_text().split()):
        for _ in range(50):
            if not _alive(pid):
                break
            time.sleep(0.1)
        assert not _alive(pid), pid


def test_run_group_returns_output_and_status():
    done = run_group([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"], timeout=60)
    assert (done.returncode, done.stdout.strip(), done.stderr.strip()) == (3, "out", "err")


@pytest.mark.slow
def test_bench_gpu_smoke_writes_rows_as_json_lines(tmp_path):
    """The cache row on the tiny shape: the environment line, one line per algorithm trained through the on-disk
    cache and the trainer's reader, then the summary."""
    out = tmp_path / "rows.jsonl"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--smoke", "--row", "cache",
                           "--workdir", str(tmp_path / "work"), "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows[0]["row"] == "cache" and "torch" in rows[0]
    trained = [r for r in rows if r.get("benchmark") == "train"]
    assert [r["algorithm"] for r in trained] == ["eagle3", "dflash"]
    for r in trained:
        assert r["reader"] == "disk" and r["cache"]["samples"] >= 16 and r["tokens_per_s"] > 0 and "error" not in r
        assert r["flops_per_token"] + r["fp32_flops_per_token"] > 0
    assert rows[-1]["summary"] and rows[-1]["rows"] == 2
