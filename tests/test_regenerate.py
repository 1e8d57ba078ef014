"""Regeneration without vLLM: the HF engine against HF's own unbatched generate (golden),
exactly-once resume over a torn / duplicated output, settings pinning, and the OpenAI engine's
retry / failure / health-probe paths against a tiny fault-injecting HTTP server."""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from deepspec.cli import main as cli_main
from deepspec.config import load_config
from deepspec.data.jsonl import read_jsonl, write_jsonl_atomic
from deepspec.data.regenerate import errors_path, is_complete, regenerate
from deepspec.errors import DataError

CONVS = [
    {"id": "m", "conversations": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "hello there"},
                                  {"role": "assistant", "content": "OLD ANSWER"}, {"role": "user", "content": "and again?"}],
     "meta": {"source": "unit"}},
    {"id": "long", "conversations": [{"role": "user", "content": "a somewhat longer prompt so that padding is needed " * 3}]},
    {"id": "c", "conversations": [{"role": "user", "content": "c"}]},
]


def setup_data(tmp_path: Path, target: str | Path, convs: list[dict], *opts: str):
    cfg = load_config(None, [f"target.name={target}", f"data.dir={tmp_path / 'data'}", "data.regenerate.heldout=false",
                             "data.regenerate.sampling.max_tokens=6", *opts])
    write_jsonl_atomic(cfg.conversations_path, convs)
    return cfg


@functools.lru_cache(maxsize=1)
def _reference_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_reference(model_dir: Path, messages: list[dict], max_new: int) -> str:
    """HF's own greedy generate on one unpadded prompt: the golden answer."""
    tok, model = _reference_model(model_dir)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True, enable_thinking=False)
    out = model.generate(**ids, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)[0, ids["input_ids"].shape[1]:]
    row = out.tolist()
    if tok.eos_token_id in row:
        row = row[: row.index(tok.eos_token_id)]
    return tok.decode(row, skip_special_tokens=True)


@pytest.mark.slow
def test_hf_engine_matches_unbatched_hf_generate_multi_turn(tmp_path, smollm2_dir):
    # The real (tiny, 135M) embedded target: its answers differ per prompt, so a padding or
    # history mistake changes the text.
    cfg = setup_data(tmp_path, smollm2_dir, CONVS, "data.regenerate.engine=hf", "data.regenerate.batch_size=3",
                     "data.regenerate.sampling.max_tokens=8")
    summary = regenerate(cfg)
    assert (summary["done"], summary["failed"]) == (3, 0)
    out = {r["id"]: r for r in read_jsonl(cfg.regenerated_path)}
    m = out["m"]["conversations"]
    assert [x["role"] for x in m] == ["system", "user", "assistant", "user", "assistant"]
    assert m[2]["content"] != "OLD ANSWER"  # original assistant turns are replaced
    assert m[2]["content"] == hf_reference(smollm2_dir, m[:2], 8)
    # The second turn is generated from the *regenerated* history.
    assert m[4]["content"] == hf_reference(smollm2_dir, m[:4], 8)
    answers = set()
    for rid in ("long", "c"):
        conv = out[rid]["conversations"]
        assert conv[1]["content"] == hf_reference(smollm2_dir, conv[:1], 8)
        answers.add(conv[1]["content"])
    assert len(answers) == 2  # distinct prompts, distinct answers: the comparison has teeth
    meta = out["m"]["meta"]
    assert meta["source"] == "unit" and meta["engine"] == "hf" and meta["sampling"]["max_tokens"] == 8
    assert meta["chat_template_kwargs"] == {"enable_thinking": False} and len(meta["template_hash"]) == 16
    assert len(meta["finish_reasons"]) == 2 and 2 <= meta["output_tokens"] <= 16


def test_resume_after_torn_and_duplicated_output_is_exactly_once(tmp_path, tiny_llama_dir):
    convs = [{"id": f"q{i}", "conversations": [{"role": "user", "content": f"question {i}"}]} for i in range(8)]
    cfg = setup_data(tmp_path, tiny_llama_dir, convs, "data.regenerate.engine=hf", "data.regenerate.batch_size=4")
    regenerate(cfg)
    lines = cfg.regenerated_path.read_bytes().splitlines(keepends=True)
    # Simulate a crash: 3 complete records, a duplicate of the first, and half of a fourth line.
    cfg.regenerated_path.write_bytes(b"".join(lines[:3]) + lines[0] + lines[3][: len(lines[3]) // 2])
    assert not is_complete(cfg)
    summary = regenerate(cfg)
    assert summary["skipped"] == 3 and summary["done"] == 5
    ids = [r["id"] for r in read_jsonl(cfg.regenerated_path)]
    assert sorted(ids) == sorted(c["id"] for c in convs)
    assert is_complete(cfg)
    again = regenerate(cfg)  # complete: nothing is generated
    assert (again["done"], again["skipped"]) == (0, 8)


def test_changed_sampling_refuses_to_mix(tmp_path, tiny_llama_dir):
    cfg = setup_data(tmp_path, tiny_llama_dir, CONVS[2:], "data.regenerate.engine=hf")
    regenerate(cfg)
    cfg.data.regenerate.sampling.temperature = 0.7
    with pytest.raises(DataError, match="sampling"):
        regenerate(cfg)
    assert not is_complete(cfg)
    assert regenerate(cfg, overwrite=True)["done"] == 1


# ----------------------------------------------------------------------------- fault-injecting server


class FakeServer:
    """A minimal OpenAI-compatible chat server: answers `ans[<n messages>]:<last user text>`;
    some prompts fail (503 twice, a dropped connection, always 500, or 400)."""

    def __init__(self):
        self.requests: list[dict] = []
        self.attempts: dict[str, int] = {}
        self.healed = False
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, obj: dict):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"data": [{"id": "fake-model", "max_model_len": 4096}]})
                else:
                    self._send(404, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                last = body["messages"][-1]["content"]
                with owner.lock:
                    owner.requests.append(body)
                    n = owner.attempts[last] = owner.attempts.get(last, 0) + 1
                if last.startswith("flaky") and n <= 2:
                    return self._send(503, {"error": "overloaded"})
                if last.startswith("drop") and n == 1:
                    self.close_connection = True
                    return  # no response at all: the client sees a broken connection
                if last.startswith("broken") and not owner.healed:
                    return self._send(500, {"error": "boom"})
                if last.startswith("bad"):
                    return self._send(400, {"error": "bad request"})
                text = f"ans[{len(body['messages'])}]:{last}"
                self._send(200, {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                                 "usage": {"completion_tokens": 3}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def fake_server():
    s = FakeServer()
    yield s
    s.close()


def test_openai_engine_retries_fails_and_reruns(tmp_path, tiny_llama_dir, fake_server):
    from deepspec.data.engines.server import free_port

    convs = [
        {"id": "multi", "conversations": [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
                                          {"role": "assistant", "content": "OLD"}, {"role": "user", "content": "u2"}]},
        {"id": "flaky", "conversations": [{"role": "user", "content": "flaky one"}]},
        {"id": "drop", "conversations": [{"role": "user", "content": "drop one"}]},
        {"id": "broken", "conversations": [{"role": "user", "content": "broken one"}]},
        {"id": "bad", "conversations": [{"role": "user", "content": "bad one"}]},
        {"id": "huge", "conversations": [{"role": "user", "content": "x" * 5000}]},  # > 4096 byte tokens
        *({"id": f"ok{i}", "conversations": [{"role": "user", "content": f"ok {i}"}]} for i in range(6)),
    ]
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there: the probe drops it
    cfg = setup_data(tmp_path, tiny_llama_dir, convs, "data.regenerate.max_retries=2",
                     "data.regenerate.concurrency_per_server=3", "data.regenerate.sampling.temperature=0.5",
                     f"data.regenerate.urls=['{fake_server.url}/v1', '{dead}']")
    cfg_file = tmp_path / "c.yaml"
    from deepspec.config import save_config

    save_config(cfg, tmp_path, "c.yaml")
    assert cli_main(["data", "regenerate", str(cfg_file)]) == 1  # one retryable failure left
    out = {r["id"]: r for r in read_jsonl(cfg.regenerated_path)}
    assert set(out) == {"multi", "flaky", "drop", *(f"ok{i}" for i in range(6))}
    assert fake_server.attempts["flaky one"] == 3 and fake_server.attempts["drop one"] == 2
    assert fake_server.attempts["broken one"] == 3  # 1 try + max_retries
    assert "x" * 5000 not in fake_server.attempts  # too long for the context: never sent
    conv = out["multi"]["conversations"]
    assert conv == [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
                    {"role": "assistant", "content": "ans[2]:u1"}, {"role": "user", "content": "u2"},
                    {"role": "assistant", "content": "ans[4]:u2"}]
    meta = out["multi"]["meta"]
    assert meta["engine"] == "openai" and meta["output_tokens"] == 6 and meta["sampling"]["temperature"] == 0.5
    body = next(b for b in fake_server.requests if b["messages"][-1]["content"] == "u2")
    assert body["model"] == "fake-model" and body["temperature"] == 0.5 and body["max_tokens"] == 6
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and "seed" in body
    errors = {r["id"]: r for r in read_jsonl(errors_path(cfg.regenerated_path))}
    assert set(errors) == {"broken", "bad", "huge"}
    assert "HTTP 500" in errors["broken"]["error"] and not errors["broken"]["permanent"]
    assert errors["bad"]["permanent"] and "HTTP 400" in errors["bad"]["error"]
    assert errors["huge"]["permanent"] and "prompt too long" in errors["huge"]["error"]
    # The server recovers: a rerun retries the failed ids, keeps the finished ones.
    fake_server.healed = True
    before = len(fake_server.requests)
    assert cli_main(["data", "regenerate", str(cfg_file)]) == 0  # only permanent failures remain
    ids = [r["id"] for r in read_jsonl(cfg.regenerated_path)]
    assert len(ids) == len(set(ids)) == 10 and "broken" in ids
    assert {r["id"] for r in read_jsonl(errors_path(cfg.regenerated_path))} == {"bad", "huge"}
    assert len(fake_server.requests) - before == 2  # 'broken' once, 'bad' once; nothing else re-sent
    assert is_complete(cfg)


def test_openai_engine_without_servers_fails_fast(tmp_path, tiny_llama_dir):
    from deepspec.data.engines.openai_engine import OpenAIEngine
    from deepspec.errors import EngineError
    from deepspec.data.engines.server import free_port

    cfg = setup_data(tmp_path, tiny_llama_dir, CONVS[2:])
    with pytest.raises(EngineError, match="No OpenAI-compatible server"):
        OpenAIEngine([f"127.0.0.1:{free_port()}"], cfg.data.regenerate.sampling, {}, probe_timeout_s=1.0)


@pytest.mark.slow
def test_engine_failure_mid_run_is_recorded_and_retried(tmp_path, tiny_llama_dir):
    from deepspec.data.engines import create_engine

    convs = [{"id": f"q{i}", "conversations": [{"role": "user", "content": f"question {i}"}]} for i in range(6)]
    cfg = setup_data(tmp_path, tiny_llama_dir, convs, "data.regenerate.engine=hf", "data.regenerate.batch_size=2")
    engine = create_engine(cfg, "hf", [])
    real, calls = engine.chat_batch, []

    def crash_on_second_batch(requests):  # the engine dies on one batch (e.g. out of memory)
        calls.append(len(requests))
        if len(calls) == 2:
            raise RuntimeError("simulated engine crash")
        return real(requests)

    engine.chat_batch = crash_on_second_batch
    summary = regenerate(cfg, engine_obj=engine)
    assert (summary["done"], summary["failed"]) == (4, 2)
    errors = read_jsonl(errors_path(cfg.regenerated_path))
    assert {e["id"] for e in errors} == {"q2", "q3"} and all("simulated engine crash" in e["error"] for e in errors)
    assert not is_complete(cfg)
    engine.chat_batch = real
    again = regenerate(cfg, engine_obj=engine)
    assert (again["done"], again["skipped"], again["failed"]) == (2, 4, 0)
    assert sorted(r["id"] for r in read_jsonl(cfg.regenerated_path)) == [c["id"] for c in convs]
    assert is_complete(cfg)


def test_vllm_server_on_cpu_runs_the_model_in_the_engine_process(monkeypatch):
    """On CPU the server's environment keeps vLLM's single-process executor (one worker process fewer to start), binds
    the model to our cores, asks for the engine process to be forked, and never overrides a value the user exported; on
    a GPU it adds none of these. The start method vLLM's CPU platform wrote into this process (an in-process engine ran
    here first) is not taken for the user's."""
    import torch

    from deepspec.data.engines import vllm_engine
    from deepspec.data.engines.server import VLLMServer
    from deepspec.vllm_plugin import FORK_ENGINE

    monkeypatch.setattr(vllm_engine, "EXPORTED_MP_METHOD", None)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    env = VLLMServer("m", port=1).server_env()
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["VLLM_CPU_OMP_THREADS_BIND"]
    assert env[FORK_ENGINE] == "1"  # the engine process forked (deepspec/vllm_plugin.py; tests/test_vllm_plugin.py)
    assert FORK_ENGINE not in VLLMServer("m", port=1, env={"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}).server_env()
    # the value vLLM's CPU platform writes into this process when an in-process engine ran here first is not the user's
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    env = VLLMServer("m", port=1).server_env()
    assert env[FORK_ENGINE] == "1" and "VLLM_WORKER_MULTIPROC_METHOD" not in env
    monkeypatch.setattr(vllm_engine, "EXPORTED_MP_METHOD", "spawn")  # exported before the process started
    env = VLLMServer("m", port=1).server_env()
    assert FORK_ENGINE not in env and env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")
    worker = VLLMServer("m", port=1, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}).server_env()
    assert worker["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and FORK_ENGINE not in worker  # a worker would fork from it
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert VLLMServer("m", port=1).server_env()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    env = VLLMServer("m", port=1).server_env()
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in env and FORK_ENGINE not in env


def test_an_in_process_vllm_engine_on_cpu_runs_in_this_process(monkeypatch):
    """Regeneration's and the capture's in-process engines on CPU: the model runs in this process (no engine-core
    process to spawn), bound to our cores; a value the user exported wins, and vLLM's own reading of it decides; on a
    GPU nothing is set. (tests/test_cache_vllm.py and the quickstart test run such engines end to end: the capture then
    drives the engine until its last saves are written.)"""
    import os

    import torch
    from vllm import envs

    from deepspec.data.engines.vllm_engine import in_process_cpu_env

    envs.disable_envs_cache()  # an engine started in this process earlier froze vLLM's reading of the environment
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert in_process_cpu_env() is True
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert in_process_cpu_env() is False and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert in_process_cpu_env() is False
    assert not {"VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND"} & set(os.environ)


def test_vllm_cpu_thread_binding_covers_every_usable_core(monkeypatch):
    """vLLM's CPU default leaves one of two cores to its idle scheduler; we bind the model's OpenMP
    threads to every core this process may use, and never override a value the user exported."""
    from deepspec.data.engines import vllm_engine

    monkeypatch.setattr(vllm_engine.os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    assert vllm_engine.cpu_thread_binding() == "0-1"
    monkeypatch.setattr(vllm_engine.os, "sched_getaffinity", lambda _: {0, 2, 3}, raising=False)
    assert vllm_engine.cpu_thread_binding() == "0,2,3"
    monkeypatch.setattr(vllm_engine.os, "sched_getaffinity", lambda _: {5}, raising=False)
    assert vllm_engine.cpu_thread_binding() == "5"
    env = vllm_engine.vllm_cpu_env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "5" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    vllm_engine.vllm_llm_kwargs("model", None, 0, {})
    assert vllm_engine.os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert vllm_engine.os.environ["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_a_server_needs_vllm_installed_not_imported_and_results_name_its_version(monkeypatch):
    """VLLMServer.start and the engine eval's results only need to know vLLM is there and which version (the server
    process imports it): without it, one sentence saying how to install it; the version is the package's own."""
    import importlib.util

    import vllm

    from deepspec.data.engines.server import VLLMServer
    from deepspec.errors import MissingDependencyError
    from deepspec.eval.engine import vllm_version

    assert vllm_version() == vllm.__version__
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(MissingDependencyError, match="scripts/setup.sh"):
        VLLMServer("m", port=1).start()


def test_vllm_sockets_go_to_a_folder_of_ours_that_a_stopped_server_removes(tmp_path, monkeypatch):
    """vLLM names its ZMQ sockets ipc://$VLLM_RPC_BASE_PATH/<uuid> (the system's temporary folder by default) and never
    removes them: three files per server start piled up in /tmp. A server gets a folder of its own, removed when it
    stops; this process's in-process engines one folder, removed at exit; a folder the user exported is kept."""
    import subprocess

    from deepspec.data.engines import vllm_engine
    from deepspec.data.engines.server import VLLMServer

    env: dict[str, str] = {}
    folder = vllm_engine.private_ipc_dir(env)
    assert env["VLLM_RPC_BASE_PATH"] == folder and Path(folder).is_dir() and Path(folder).name.startswith("deepspec-ipc-")
    assert vllm_engine.private_ipc_dir({"VLLM_RPC_BASE_PATH": str(tmp_path)}) is None  # the user's
    server = VLLMServer("m", port=1, log_path=tmp_path / "server.log")
    server._proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    server.ipc_dir = folder
    (Path(folder) / "sock").write_text("")
    server.stop()
    assert not Path(folder).exists() and server.ipc_dir is None
    # the in-process engines' folder is in os.environ, yet a server started from this process gets its own
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "")  # empty = unset, and restored after the test (later servers here)
    monkeypatch.setattr(vllm_engine, "_PROCESS_IPC_DIR", None)
    vllm_engine.in_process_ipc_dir()
    shared = os.environ["VLLM_RPC_BASE_PATH"]
    assert shared == vllm_engine._PROCESS_IPC_DIR and Path(shared).is_dir()
    served = dict(os.environ)
    own = vllm_engine.private_ipc_dir(served)
    assert own not in (None, shared) and served["VLLM_RPC_BASE_PATH"] == own
    for f in (own, shared):
        Path(f).rmdir()
