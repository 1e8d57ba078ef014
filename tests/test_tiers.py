"""The suite's skip policy (tests/conftest.py): a CUDA-only test skips without a GPU and is listed in the summary; under
CI=true any other skip fails, so a side install that broke cannot pass as "skipped"."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

SAMPLE = '''
import pytest

def test_side_install_missing():
    pytest.skip("the sglang package could not be installed")

@pytest.mark.cuda(reason="a kernel")
def test_on_the_gpu():
    assert False, "must not run without CUDA"

def test_plain():
    assert True
'''


@pytest.fixture(scope="module")
def sample_suite(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiers")
    shutil.copy(HERE / "conftest.py", d / "conftest.py")
    (d / "test_sample.py").write_text(SAMPLE)
    (d / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda(reason): needs a CUDA GPU\n")
    return d


def _run(d: Path, ci: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CI=ci, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", *args, str(d)],
                          capture_output=True, text=True, env=env, cwd=str(d), timeout=300)


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile"]], ids=["serial", "two-workers"])
def test_a_skip_fails_under_ci_but_cuda_only_tests_are_listed(sample_suite, workers):
    """The same policy and summary when the suite runs on parallel workers (scripts/test.sh's default)."""
    r = _run(sample_suite, "true", *workers)
    assert r.returncode == 1, r.stdout
    assert "1 failed, 1 passed, 1 skipped" in r.stdout, r.stdout
    assert "skipped under CI=true (the sglang package could not be installed)" in r.stdout
    assert "CUDA-only: 1 tests not run without a GPU" in r.stdout and "test_sample.py::test_on_the_gpu" in r.stdout


def test_outside_ci_a_skip_is_a_skip(sample_suite):
    r = _run(sample_suite, "")
    assert r.returncode == 0, r.stdout
    assert "1 passed, 2 skipped" in r.stdout, r.stdout


PIN = '''
import json, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
from conftest import pin_worker_cores
env = {"PYTEST_XDIST_WORKER": sys.argv[2], "PYTEST_XDIST_WORKER_COUNT": sys.argv[3]}
got = pin_worker_cores(env)
import torch
child = subprocess.run([sys.executable, "-c", "from deepspec.cpus import usable_cpus; import torch; print(usable_cpus(), torch.get_num_threads())"],
                       capture_output=True, text=True).stdout.split(" ", 1) if got else None
print(json.dumps({"got": got, "now": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(), "child": child}))
'''


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_parallel_workers_take_disjoint_cores_and_their_children_inherit_them():
    """pin_worker_cores (tests/conftest.py): worker i of n takes the i-th n-th of the usable cores, sets torch's threads
    to that many, and a process it starts sees the same cores and sizes its threads from them; one process alone, or
    more workers than cores, is not pinned."""
    import json

    from deepspec.cpus import usable_cpus

    cores = usable_cpus()

    def pin(worker: str, count: int) -> dict:
        out = subprocess.run([sys.executable, "-c", PIN, str(HERE), worker, str(count)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    if len(cores) >= 2:
        per = len(cores) // 2
        first, second = pin("gw0", 2), pin("gw1", 2)
        assert first["got"] == first["now"] == cores[:per] and second["got"] == second["now"] == cores[per : 2 * per]
        assert not set(first["got"]) & set(second["got"])
        for r in (first, second):
            assert r["threads"] == per and r["child"] == [str(r["got"]), f"{per}\n"], r
    lone = pin("gw0", 1)
    assert lone["got"] is None and lone["now"] == cores
    crowd = pin("gw0", len(cores) + 1)
    assert crowd["got"] is None and crowd["now"] == cores


def test_the_second_worker_does_not_start_by_waiting_for_the_embedded_target():
    """The first two modules start at once on the two workers: when both need the embedded target, the first module
    that does not moves to second place (the queue otherwise keeps its order); nothing moves when one of them is free."""
    from types import SimpleNamespace

    from conftest import _second_worker_starts_without_the_embedded_target as reorder

    def items(spec: str) -> list:
        return [SimpleNamespace(nodeid=f"tests/{m}.py::t{i}", fixturenames=["tmp_path"] + ["smollm2_dir"] * (m.isupper()))
                for m in spec for i in range(2)]

    def order(spec: str) -> str:
        got = items(spec)
        reorder(got)
        return "".join(dict.fromkeys(it.nodeid.split("/")[1][0] for it in got))

    assert order("ABcDe") == "AcBDe"
    assert order("AbCd") == "AbCd" and order("aBC") == "aBC" and order("ABC") == "ABC"
