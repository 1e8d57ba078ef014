"""Servers dying under load, in regeneration and in the engine-backed eval: three OpenAI-compatible server processes
with 96 requests in flight; one is SIGKILLed mid-run, then all of them. The servers are small HTTP processes that
answer like vLLM's chat endpoint after a delay and count like its /metrics (a real vLLM server takes ~90 s to start on
2 CPU cores; the code under test only sees HTTP)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SERVER = r"""
import json, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

lock, inflight = threading.Lock(), [0]
# vLLM's speculative-decoding counters as /metrics reports them: each answered request adds one draft of 2 tokens and
# k = its prompt's number mod 3 accepted ones (k >= 1 at position 0, k >= 2 at position 1)
counts = {"drafts": 0, "tokens": 0, "accepted": 0, "pos0": 0, "pos1": 0}

def metrics():
    c = counts
    return "\n".join([
        "# TYPE vllm:spec_decode_num_drafts counter",
        f'vllm:spec_decode_num_drafts_total{{model_name="tiny"}} {c["drafts"]}.0',
        f'vllm:spec_decode_num_draft_tokens_total{{model_name="tiny"}} {c["tokens"]}.0',
        f'vllm:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {c["accepted"]}.0',
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="0"}} {c["pos0"]}.0',
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="1"}} {c["pos1"]}.0', ""])

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/metrics":
            with lock:
                data = metrics().encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self._send({"data": [{"id": "tiny", "max_model_len": 4096}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:
            inflight[0] += 1
            print(f"start {body['messages'][-1]['content']} inflight={inflight[0]}", flush=True)
        time.sleep(0.6)
        k = int("".join(ch for ch in body["messages"][-1]["content"] if ch.isdigit()) or 0) % 3
        with lock:
            inflight[0] -= 1
            counts["drafts"] += 1
            counts["tokens"] += 2
            counts["accepted"] += k
            counts["pos0"] += k >= 1
            counts["pos1"] += k >= 2
        self._send({"choices": [{"message": {"role": "assistant", "content": "answer to " + body["messages"][-1]["content"]},
                                 "finish_reason": "stop"}], "usage": {"completion_tokens": 3}})

class Server(ThreadingHTTPServer):
    request_queue_size = 512
    daemon_threads = True

httpd = Server(("127.0.0.1", 0), Handler)
print(f"port {httpd.server_address[1]}", flush=True)
httpd.serve_forever()
"""


class Servers:
    def __init__(self, tmp_path: Path, n: int):
        self.procs, self.urls, self.logs = [], [], []
        for i in range(n):
            log = tmp_path / f"server_{i}.log"
            proc = subprocess.Popen([sys.executable, "-u", "-c", SERVER], stdout=open(log, "w"), stderr=subprocess.STDOUT)
            self.procs.append(proc)
            self.logs.append(log)
        for log in self.logs:
            t0 = time.monotonic()
            while "port " not in log.read_text():
                assert time.monotonic() - t0 < 30, "server did not start"
                time.sleep(0.05)
            self.urls.append(f"http://127.0.0.1:{log.read_text().split('port ')[1].split()[0]}")

    def inflight_total(self) -> int:
        """Requests started and not answered, over all servers, from their logs (last inflight= per server)."""
        total = 0
        for log in self.logs:
            lines = [ln for ln in log.read_text().splitlines() if "inflight=" in ln]
            total += int(lines[-1].rsplit("=", 1)[1]) if lines else 0
        return total

    def started(self, i: int) -> list[str]:
        return [ln.split()[1] for ln in self.logs[i].read_text().splitlines() if ln.startswith("start ")]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def servers(tmp_path):
    made = []

    def make(n: int) -> Servers:
        s = Servers(tmp_path, n)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _setup(tmp_path: Path, target: Path, servers: Servers, n_jobs: int):
    from deepspec.config import load_config
    from deepspec.data.jsonl import write_jsonl_atomic

    urls_file = tmp_path / "urls.txt"
    urls_file.write_text("".join(f"{u}  # log: {log}\n" for u, log in zip(servers.urls, servers.logs)))
    cfg = load_config(None, [f"target.name={target}", f"data.dir={tmp_path / 'data'}", "data.regenerate.heldout=false",
                             "data.regenerate.engine=openai", f"data.regenerate.urls_file={urls_file}",
                             "data.regenerate.concurrency_per_server=32", "data.regenerate.sampling.max_tokens=4"])
    write_jsonl_atomic(cfg.conversations_path, [{"id": f"q{i}", "conversations": [{"role": "user", "content": f"q{i}"}]}
                                                for i in range(n_jobs)])
    return cfg


def _engine(cfg, grace: float):
    from deepspec.data.engines.openai_engine import OpenAIEngine, read_urls

    rc = cfg.data.regenerate
    urls = read_urls([], rc.urls_file)
    return OpenAIEngine(urls, rc.sampling, cfg.target.chat_template_kwargs, concurrency_per_server=32, max_retries=4,
                        backoff_base_s=0.2, down_grace_s=grace, reprobe_s=0.5)


def _kill_when(servers: Servers, at_least: int, which: list[int], seen: list[int], started: int = 0) -> threading.Thread:
    """SIGKILL servers `which` once `at_least` requests are in flight over all servers and each of them has started
    `started` requests (so that some of its answers are already counted)."""
    def run() -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            n = servers.inflight_total()
            if n >= at_least and all(len(servers.started(i)) >= started for i in which):
                break
            time.sleep(0.02)
        seen.append(n)  # in flight at the moment the condition held
        for i in which:
            os.kill(servers.procs[i].pid, signal.SIGKILL)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_server_killed_with_requests_in_flight_costs_nothing_and_duplicates_nothing(tmp_path, tiny_llama_dir, servers):
    from deepspec.data.jsonl import read_jsonl
    from deepspec.data.regenerate import regenerate

    srv = servers(3)
    cfg = _setup(tmp_path, tiny_llama_dir, srv, 288)
    seen: list[int] = []
    killer = _kill_when(srv, 64, [1], seen)
    summary = regenerate(cfg, engine_obj=_engine(cfg, grace=30))
    killer.join()
    assert seen[0] >= 64  # requests in flight over the three servers when server 1 was killed
    rows = read_jsonl(cfg.regenerated_path)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 288 and summary["failed"] == 0  # duplicates: 0, lost: 0
    assert all(r["conversations"][-1]["content"] == f"answer to {r['id']}" for r in rows)
    lost_in_flight = [q for q in srv.started(1)]
    assert lost_in_flight and set(lost_in_flight) <= set(ids)  # its unanswered requests were answered elsewhere


def test_every_server_gone_stops_the_stage_with_one_sentence_naming_the_logs(tmp_path, tiny_llama_dir, servers):
    from deepspec.data.jsonl import read_jsonl
    from deepspec.data.regenerate import regenerate
    from deepspec.errors import EngineError

    srv = servers(3)
    cfg = _setup(tmp_path, tiny_llama_dir, srv, 288)
    killer = _kill_when(srv, 64, [0, 1, 2], [])
    t0 = time.monotonic()
    with pytest.raises(EngineError) as err:
        regenerate(cfg, engine_obj=_engine(cfg, grace=2))
    killer.join()
    message = str(err.value)
    assert message.startswith("Every regeneration server stopped answering for 2 s")
    assert all(str(log) in message for log in srv.logs) and "rerun the same command" in message
    assert time.monotonic() - t0 < 60
    kept = [r["id"] for r in read_jsonl(cfg.regenerated_path)] if cfg.regenerated_path.exists() else []
    assert len(kept) == len(set(kept)) < 288
    # servers back: the rerun answers only the rest
    again = servers(2)
    (tmp_path / "urls.txt").write_text("".join(f"{u}  # log: {log}\n" for u, log in zip(again.urls, again.logs)))
    summary = regenerate(cfg, engine_obj=_engine(cfg, grace=30))
    ids = [r["id"] for r in read_jsonl(cfg.regenerated_path)]
    assert len(ids) == len(set(ids)) == 288 and summary["skipped"] == len(kept)


def _engine_eval(tmp_path: Path, target: Path, servers: Servers, grace: float, two_turn: int = 96):
    """The engine-backed eval over `servers` (eval.engine_urls_file) on 192 conversations, the last 96 of them two turns."""
    from deepspec.config import load_config
    from deepspec.eval.engine import engine_eval
    from deepspec.eval.runner import WorkItem

    urls_file = tmp_path / "eval_urls.txt"
    urls_file.write_text("".join(f"{u}  # log: {log}\n" for u, log in zip(servers.urls, servers.logs)))
    cfg = load_config(None, [f"target.name={target}", "eval.engine=vllm", f"eval.engine_urls_file={urls_file}",
                             "eval.engine_max_concurrency=32", f"eval.engine_down_grace_s={grace}", "eval.num_draft_tokens=2",
                             "eval.temperature=0", "eval.max_new_tokens=4"])
    items = [WorkItem("bench", i, {"turns": [f"p{i}"] + ([f"p{i}b{i + 1}"] if i >= 192 - two_turn else [])}) for i in range(192)]
    ours = {"tasks": {"bench": {"expected_accepted": [0.5, 0.2], "survival": [0.5, 0.2], "tau": 1.7}},
            "overall": {"expected_accepted": [0.5, 0.2], "survival": [0.5, 0.2], "tau": 1.7}}
    return engine_eval(cfg, tmp_path / "ckpt", {"algorithm": "eagle3"}, str(target), items, ours, tmp_path), items


def _expected_counts(items) -> dict[str, int]:
    """What the servers count when every turn of every conversation is answered exactly once."""
    ks = [int("".join(ch for ch in turn if ch.isdigit())) % 3 for it in items for turn in it.row["turns"]]
    return {"drafts": len(ks), "accepted": sum(ks), "pos0": sum(k >= 1 for k in ks), "pos1": sum(k >= 2 for k in ks)}


def test_engine_eval_server_killed_under_load_counts_every_conversation_exactly_once(tmp_path, tiny_llama_dir, servers, logs):
    srv = servers(3)
    seen: list[int] = []
    killer = _kill_when(srv, 64, [1], seen, started=40)  # its first 32 answers counted, the next ones in flight
    out, items = _engine_eval(tmp_path, tiny_llama_dir, srv, grace=30)
    killer.join()
    assert seen[0] >= 64  # requests in flight over the three servers when server 1 was killed
    want = _expected_counts(items)
    cell = out["overall"]
    got = {"drafts": cell["engine_drafts"], "accepted": cell["engine_accepted_tokens"],
           "pos0": cell["engine_accepted_per_pos"][0], "pos1": cell["engine_accepted_per_pos"][1]}
    assert got == want  # nothing counted twice, nothing lost
    assert cell["engine_draft_tokens"] == 2 * want["drafts"] and cell["engine_tau"] == 1 + want["accepted"] / want["drafts"]
    assert out["conversations_redone_after_a_server_died"] > 0 and out["servers"] == 3
    assert any("stopped answering" in m and str(srv.logs[1]) in m for m in logs.messages)


def test_engine_eval_with_every_server_gone_stops_with_one_sentence_naming_the_logs(tmp_path, tiny_llama_dir, servers):
    from deepspec.errors import EngineError

    srv = servers(3)
    killer = _kill_when(srv, 64, [0, 1, 2], [])
    t0 = time.monotonic()
    with pytest.raises(EngineError) as err:
        _engine_eval(tmp_path, tiny_llama_dir, srv, grace=2)
    killer.join()
    message = str(err.value)
    assert message.startswith("Every vLLM server of the engine eval stopped answering for 2 s") and "\n" not in message
    assert all(str(log) in message for log in srv.logs) and "results.json" in message
    assert time.monotonic() - t0 < 60
