"""Servers dying under load, in regeneration and in the engine-backed eval: three OpenAI-compatible server processes
with 96 requests in flight; one is SIGKILLed mid-run, then all of them. In the engine-backed eval also a server that
answers 503 for a while and one slower than the request timeout for a few requests, both recording their stats after
the answer as vLLM may. The servers are small HTTP processes that answer like vLLM's chat endpoint after a delay and
count like its /metrics (a real vLLM server takes ~90 s to start on 2 CPU cores; the code under test only sees HTTP)."""

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
# optional behaviour (argv[1], JSON): "late": seconds after the answer its stats are recorded (vLLM records them after
# sending it); "unavailable_after" / "unavailable_s": once that many requests are answered, every chat request for
# that many seconds is answered 503 at once; "slow": [first, count, seconds]: the requests received as number
# first..first+count-1 take that long (and are still counted when the client has given up); "delay": seconds every
# other request takes (0.6)
opts = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
received, answered, window = [0], [0], [None]
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
            if window[0] is not None and time.monotonic() - window[0] < opts["unavailable_s"]:
                print(f"unavailable {body['messages'][-1]['content']}", flush=True)
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            received[0] += 1
            n = received[0]
            inflight[0] += 1
            print(f"start {body['messages'][-1]['content']} inflight={inflight[0]}", flush=True)
        first, count, seconds = opts.get("slow", [0, 0, 0])
        slow = first <= n < first + count
        if slow:
            print(f"slow {body['messages'][-1]['content']}", flush=True)
        time.sleep(seconds if slow else opts.get("delay", 0.6))
        k = int("".join(ch for ch in body["messages"][-1]["content"] if ch.isdigit()) or 0) % 3

        def record():
            with lock:
                counts["drafts"] += 1
                counts["tokens"] += 2
                counts["accepted"] += k
                counts["pos0"] += k >= 1
                counts["pos1"] += k >= 2

        with lock:
            inflight[0] -= 1
            answered[0] += 1
            if answered[0] == opts.get("unavailable_after"):
                window[0] = time.monotonic()
        if not opts.get("late"):
            record()
        try:
            self._send({"choices": [{"message": {"role": "assistant", "content": "answer to " + body["messages"][-1]["content"]},
                                     "finish_reason": "stop"}], "usage": {"completion_tokens": 3}})
        except OSError:  # the client gave up (timed out): the engine still did the work
            pass
        if opts.get("late"):
            threading.Timer(opts["late"], record).start()

class Server(ThreadingHTTPServer):
    request_queue_size = 512
    daemon_threads = True

httpd = Server(("127.0.0.1", 0), Handler)
print(f"port {httpd.server_address[1]}", flush=True)
httpd.serve_forever()
"""


class Servers:
    def __init__(self, tmp_path: Path, n: int, opts: dict | None = None):
        self.procs, self.urls, self.logs = [], [], []
        for i in range(n):
            log = tmp_path / f"server_{i}.log"
            proc = subprocess.Popen([sys.executable, "-u", "-c", SERVER, json.dumps(opts or {})], stdout=open(log, "w"),
                                    stderr=subprocess.STDOUT)
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

    def started(self, i: int, what: str = "start") -> list[str]:
        return [ln.split()[1] for ln in self.logs[i].read_text().splitlines() if ln.startswith(what + " ")]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def servers(tmp_path):
    made = []

    def make(n: int, opts: dict | None = None) -> Servers:
        s = Servers(tmp_path, n, opts)
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


# the pool tests' ordinary answers: 0.25 s (well inside the 1 s request timeout, and 288 requests at 32 in flight still
# keep the server busy for ~2 s around its 503 window or its slow requests) instead of the 0.6 s that makes a server
# killed mid-run hold requests in flight
FAST = 0.25


def _pool_eval(tmp_path: Path, target: Path, servers: Servers, timeout_s: float):
    """The engine eval's pool (eval/engine_pool.py) with its real chat client over `servers`, a request timeout of
    `timeout_s` and counters settled over 0.8 s, on the 192 conversations of `_engine_eval`; returns (counter delta,
    pool, items)."""
    from deepspec.config import load_config
    from deepspec.eval.engine import _Client, _metrics_from_url
    from deepspec.eval.engine_pool import Endpoint, Job, ServerPool
    from deepspec.eval.runner import WorkItem
    from deepspec.targets import load_tokenizer

    cfg = load_config(None, [f"target.name={target}", "eval.temperature=0", "eval.max_new_tokens=4"])
    tok = load_tokenizer(str(target))
    endpoints = [Endpoint(u, _Client(u + "/v1", "tiny", tok, cfg, 4096, seeded=False, timeout_s=timeout_s),
                          lambda u=u: _metrics_from_url(u), log=str(lg)) for u, lg in zip(servers.urls, servers.logs)]
    pool = ServerPool(endpoints, 32, down_grace_s=30, reprobe_s=0.2, settle_s=0.8, settle_max_s=10)
    items = [WorkItem("bench", i, {"turns": [f"p{i}"] + ([f"p{i}b{i + 1}"] if i >= 96 else [])}) for i in range(192)]
    delta, skipped = pool.run([Job(it.row["turns"], i) for i, it in enumerate(items)], "vLLM bench")
    assert skipped == 0
    return delta, pool, items


def _counted(delta) -> dict[str, int]:
    return {"drafts": delta["drafts"], "accepted": delta["accepted_tokens"], "pos0": delta["accepted_per_pos"][0],
            "pos1": delta["accepted_per_pos"][1]}


def test_engine_eval_server_answering_503_for_a_while_counts_every_request_exactly_once(tmp_path, tiny_llama_dir, servers, logs):
    """One server, 32 requests in flight, that answers 503 to every request for 1.5 s once 40 are answered (the
    requests it had already accepted are answered and counted) and records each request's stats 0.1 s after its
    answer: it leaves, rejoins once its requests are back and its counters settled, maybe leaves again, and in the
    end every request is counted once."""
    srv = servers(1, {"unavailable_after": 40, "unavailable_s": 1.5, "late": 0.1, "delay": FAST})
    delta, pool, items = _pool_eval(tmp_path, tiny_llama_dir, srv, timeout_s=30)
    assert srv.started(0, "unavailable")  # it did answer 503
    assert _counted(delta) == _expected_counts(items)  # nothing counted twice, nothing lost
    # it left with the benchmark's conversations to run again: the ones it had finished (about 40: the 503s begin after
    # its 40th answer is sent, which the pool may not have read yet) and the ones still running there
    assert delta["draft_tokens"] == 2 * delta["drafts"] and pool.redone > 0
    assert any("answers again" in m for m in logs.messages)


def test_engine_eval_server_slower_than_the_request_timeout_counts_every_request_exactly_once(tmp_path, tiny_llama_dir, servers, logs):
    """One server, 32 requests in flight, whose 60th and 61st requests take 1.5 s against a 1 s request timeout: the
    server counts them after the client gave up. The eval leaves it, waits until its other requests are back and its
    counters settled (which takes the timed-out ones in), rejoins it, and counts every request once. (Stats are
    recorded at the answer here: recorded late, the missed stats of the last answers, which are the reruns of the
    timed-out conversations, would hide their double count.)"""
    srv = servers(1, {"slow": [60, 2, 1.5], "delay": FAST})
    delta, pool, items = _pool_eval(tmp_path, tiny_llama_dir, srv, timeout_s=1.0)
    assert len(srv.started(0, "slow")) == 2  # two requests outlived the timeout
    assert _counted(delta) == _expected_counts(items)
    assert pool.redone > 0 and any("ReadTimeout" in m for m in logs.messages)
    assert any("answers again" in m for m in logs.messages)
