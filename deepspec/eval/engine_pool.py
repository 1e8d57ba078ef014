"""The engine-backed eval over one or several vLLM servers, counted exactly once when a server dies.

vLLM reports acceptance only as process-wide Prometheus counters, so a server that dies takes the counts of every
request it answered with it, and a restarted one starts again from zero. To keep each benchmark's counts exact:

- every conversation runs all its turns on one server (MT-Bench's second turn where its first was answered);
- a server that stops answering (connection refused or reset, a timeout, a dead engine) leaves the benchmark at
  once, and *every* conversation of that benchmark it held, finished or not, runs again on the servers still
  answering;
- a benchmark's counts are the sum of the counter deltas of the servers that answered to its end, read before and
  after it: each conversation counted once, on one server.

A server that left may still be running requests of ours (a timed-out one keeps running until the engine notices, an
answer in flight was already counted), and vLLM records a request's stats after it sends the answer. So counters are
read *settled*: read again every `settle_s` until two reads agree (at most `settle_max_s`), at the end of every
benchmark and whenever a server that left rejoins; and a server that left rejoins (probed every `reprobe_s`) only once
every request it was sent has come back or timed out on our side and its counters have settled. An answer from a
server that left and rejoined since counts nowhere and runs again. When no server has answered for `down_grace_s`
seconds, the eval stops with one sentence naming the servers and their logs.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

from deepspec.config.secrets import redact_text
from deepspec.errors import EngineError
from deepspec.log import get_logger, progress

log = get_logger(__name__)

COUNTER_KEYS = ("drafts", "draft_tokens", "accepted_tokens")


class ServerDown(EngineError):
    """A server that stopped answering a request (connection refused / reset, timeout, dead engine)."""


@dataclass(eq=False)
class Endpoint:
    """One vLLM server: where to send chats, how to read its counters, where its log is."""

    url: str  # the server root, http://host:port
    client: Any  # eval.engine._Client bound to url + /v1
    counters: Callable[[], dict[str, Any]]
    log: str | None = None
    exited: Callable[[], bool] = lambda: False  # a process we started and saw exit: it will not come back
    up: bool = True
    why: str = ""
    left: bool = False  # it left once: requests of ours may still move its counters, so it rejoins on settled counters


@dataclass
class Job:
    """One conversation: its turns, seed and system prompt."""

    turns: list[str]
    seed: int
    system: str | None = None


@dataclass
class _Task:
    """The bookkeeping of one benchmark's run over the pool."""

    jobs: list[Job]
    before: dict[Endpoint, dict[str, Any]] = field(default_factory=dict)  # the servers counted for this benchmark
    done_on: dict[int, Endpoint] = field(default_factory=dict)
    skipped: dict[int, int] = field(default_factory=dict)
    inflight: dict[Future, tuple[int, Endpoint, int]] = field(default_factory=dict)  # (job, server, its join number)
    joins: dict[Endpoint, int] = field(default_factory=dict)  # how often each server joined this benchmark


def sum_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Counter deltas of several servers (or benchmarks) added up, with their rates recomputed."""
    from deepspec.data.engines.server import with_rates

    out: dict[str, Any] = {k: sum(d[k] for d in deltas) for k in COUNTER_KEYS}
    width = max((len(d["accepted_per_pos"]) for d in deltas), default=0)
    out["accepted_per_pos"] = [sum(d["accepted_per_pos"][i] for d in deltas if i < len(d["accepted_per_pos"])) for i in range(width)]
    return with_rates(out)


class ServerPool:
    """Runs benchmarks' conversations over `endpoints` and returns each benchmark's exact counter deltas."""

    def __init__(self, endpoints: list[Endpoint], concurrency: int, *, down_grace_s: float = 60.0, reprobe_s: float = 2.0,
                 settle_s: float = 1.0, settle_max_s: float = 30.0):
        self.endpoints = endpoints
        self.concurrency = max(1, concurrency)
        self.down_grace_s = down_grace_s
        self.reprobe_s = reprobe_s
        self.settle_s = settle_s
        self.settle_max_s = settle_max_s
        self.redone = 0  # finished conversations run again because their server died

    # --- one benchmark ---------------------------------------------------------------------------------------

    def run(self, jobs: list[Job], desc: str) -> tuple[dict[str, Any], int]:
        """Run every conversation once on a server that answered to the end; returns (counter delta, requests
        skipped as too long for the server's context)."""
        from deepspec.data.engines.server import counters_delta

        task = _Task(jobs)
        for e in self.endpoints:
            self._join(task, e)
        bar = progress(total=len(jobs), desc=desc, unit="sample")
        with ThreadPoolExecutor(max_workers=self.concurrency * len(self.endpoints)) as pool:
            while True:
                self._run_pending(task, pool, bar)
                after: dict[Endpoint, dict[str, Any]] = {}
                for e, (c, err) in self._settled(list(task.before)).items():
                    if err is None:
                        after[e] = c
                    else:  # a server that cannot report its counters is down
                        self._leave(task, e, err, bar)
                if len(task.done_on) == len(jobs) and set(after) == set(task.before):
                    break
        bar.close()
        delta = sum_deltas([counters_delta(task.before[e], after[e]) for e in task.before])
        return delta, sum(task.skipped.values())

    def _run_pending(self, task: _Task, pool: ThreadPoolExecutor, bar) -> None:
        """Submit every conversation not yet done (or redone) and wait for all of them."""
        pending = [i for i in range(len(task.jobs)) if i not in task.done_on]
        while pending or task.inflight:
            while pending:
                live = [e for e in task.before if e.up]
                if not live:
                    self._wait_for_a_server(task)
                    continue
                i = pending.pop(0)
                e = min(live, key=lambda s: sum(1 for _, o, _ in task.inflight.values() if o is s))
                job = task.jobs[i]
                task.inflight[pool.submit(e.client.conversation, job.turns, job.seed, job.system)] = (i, e, task.joins[e])
            if not task.inflight:
                break
            finished, _ = wait(list(task.inflight), return_when=FIRST_COMPLETED)
            for f in finished:
                i, e, joined = task.inflight.pop(f)
                err = f.exception()
                current = e in task.before and task.joins[e] == joined
                if isinstance(err, ServerDown):
                    if current:
                        pending.extend(self._leave(task, e, str(err), bar))
                    pending.append(i)
                elif err is not None:
                    raise err
                elif not current:  # answered by a server that left (and maybe rejoined) since: counted nowhere, run it again
                    pending.append(i)
                else:
                    task.done_on[i] = e
                    task.skipped[i] = f.result() or 0
                    bar.update(1)

    # --- servers leaving and joining ---------------------------------------------------------------------------

    def _settled(self, endpoints: list[Endpoint]) -> dict[Endpoint, tuple[dict[str, Any] | None, str | None]]:
        """Each server's counters once two reads `settle_s` apart agree: (counters, None), or (None, why) for a server
        that did not answer. A server still moving after `settle_max_s` (another client's requests) gives its last read,
        with a warning."""
        out: dict[Endpoint, tuple[dict[str, Any] | None, str | None]] = {}
        last: dict[Endpoint, dict[str, Any]] = {}
        t0 = time.monotonic()
        while True:
            for e in endpoints:
                if e in out:
                    continue
                try:
                    c = e.counters()
                except Exception as err:  # noqa: BLE001 - reported to the caller as the server being down
                    out[e] = (None, f"{type(err).__name__}: {err}")
                    continue
                if e in last and c == last[e]:
                    out[e] = (c, None)
                last[e] = c
            moving = [e for e in endpoints if e not in out]
            if not moving:
                return out
            if time.monotonic() - t0 >= self.settle_max_s:
                for e in moving:
                    log.warning("vLLM server %s: its speculative-decoding counters still moved after %g s of reads; the last "
                                "read is used (another client's requests are counted too)", redact_text(e.url), self.settle_max_s)
                    out[e] = (last[e], None)
                return out
            time.sleep(self.settle_s)

    def _join(self, task: _Task, e: Endpoint) -> bool:
        """Count `e` for this benchmark from now on, if it answers: one read of its counters (the probe and the snapshot
        at once), or, for a server that left, settled counters once every request sent to it has come back."""
        if e.exited():
            e.up = False
            return False
        if e.left and any(o is e and not f.done() for f, (_, o, _) in task.inflight.items()):
            e.why = e.why or "requests of ours still running on it"
            return False  # its counters may still move with them: not yet
        if e.left:
            c, err = self._settled([e])[e]
        else:
            try:
                c, err = e.counters(), None
            except Exception as ex:  # noqa: BLE001
                c, err = None, f"{type(ex).__name__}: {ex}"
        if err is not None:
            e.up, e.why = False, redact_text(err.splitlines()[0][:200])
            return False
        task.before[e] = c
        task.joins[e] = task.joins.get(e, 0) + 1
        if not e.up:
            log.warning("vLLM server %s answers again: it rejoins the engine eval", redact_text(e.url))
        e.up, e.why, e.left = True, "", False
        return True

    def _leave(self, task: _Task, e: Endpoint, why: str, bar) -> list[int]:
        """`e` stopped answering: it no longer counts for this benchmark. Returns its finished conversations, to be
        run again elsewhere (those still running on it come back as failures or as answers counted nowhere)."""
        if e not in task.before:
            return []
        del task.before[e]
        e.up, e.left, e.why = False, True, redact_text(why.splitlines()[0][:200]) if why else "no answer"
        lost = [i for i, o in task.done_on.items() if o is e]
        for i in lost:
            del task.done_on[i]
            task.skipped.pop(i, None)
        self.redone += len(lost)
        bar.update(-len(lost))
        running = sum(1 for _, o, _ in task.inflight.values() if o is e)
        log.warning("vLLM server %s stopped answering (%s): its %d finished and %d running or queued conversation(s) of this "
                    "benchmark run again on the other servers, so each is counted once%s", redact_text(e.url), e.why,
                    len(lost), running, f"; its log: {e.log}" if e.log else "")
        return lost

    def _wait_for_a_server(self, task: _Task) -> None:
        """No server is left for this benchmark: probe them until one answers, or stop after down_grace_s."""
        t0 = time.monotonic()
        while True:
            for e in self.endpoints:
                if e not in task.before and self._join(task, e):
                    return
            if all(e.exited() for e in self.endpoints) or time.monotonic() - t0 >= self.down_grace_s:
                break
            time.sleep(self.reprobe_s)
        raise EngineError(self.all_down_sentence())

    def all_down_sentence(self) -> str:
        whys = "; ".join(f"{redact_text(e.url)}: {e.why or 'no answer'}" for e in self.endpoints)
        logs = [f"{redact_text(e.url)}: {e.log}" for e in self.endpoints if e.log]
        gone = all(e.exited() for e in self.endpoints)
        return (f"Every vLLM server of the engine eval stopped answering{'' if gone else f' for {self.down_grace_s:g} s'} ({whys})"
                + (f"; see {'its' if len(self.endpoints) == 1 else 'their'} log{'s' if len(logs) > 1 else ''} "
                   f"({', '.join(logs)})" if logs else "")
                + ". Our own results are saved in results.json; restart the server(s) and rerun the eval for the "
                  "engine's figures.")
