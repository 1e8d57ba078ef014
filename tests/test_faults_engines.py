"""Regeneration servers dying under load: three OpenAI-compatible server processes with 96 requests in flight; one is
SIGKILLed mid-run, then all of them. The servers are small HTTP processes that answer like vLLM's chat endpoint after
a delay (a real vLLM server takes ~90 s to start on 2 CPU cores; the engine under test only sees HTTP)."""

from __future__ import annotations

import json
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
        self._send({"data": [{"id": "tiny", "max_model_len": 4096}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:
            inflight[0] += 1
            print(f"start {body['messages'][-1]['content']} inflight={inflight[0]}", flush=True)
        time.sleep(0.6)
        with lock:
            inflight[0] -= 1
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


def _kill_when(servers: Servers, at_least: int, which: list[int], seen: list[int]) -> threading.Thread:
    def run() -> None:
        t0 = time.monotonic()
        while servers.inflight_total() < at_least and time.monotonic() - t0 < 60:
            time.sleep(0.02)
        seen.append(servers.inflight_total())
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
