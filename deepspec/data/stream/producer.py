"""Producers of streamed training: run the target (HF or vLLM's extract_hidden_states, as a cache build does) on the
samples the trainer will read next, and write them into the spool (deepspec/data/stream/spool.py).

`deepspec data stream CONFIG --producer W --producers N` is one producer; N of them (one per GPU, or per node with
the target's own tensor / expert parallelism) share the trainer's plan: producer W makes the samples at plan
positions p with p % N == W. What a producer makes is a pure function of the recipe and the trainer's position, so
a producer may be killed and restarted at any time: it finds what is missing and makes it. With
`cache.stream_producers` > 0 the trainer's rank 0 starts that many producers on its own machine and stops them when
it exits (they also stop when it dies).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deepspec.data.batches import BatchPlan
from deepspec.data.cache.featurizer import encode_sample, length_batches, make_featurizer
from deepspec.data.cache.plan import load_plan_inputs, make_plan, materialize
from deepspec.data.cache.sample import Sample
from deepspec.data.stream import spool as sp
from deepspec.data.stream.channel import FileChannel, open_channel
from deepspec.data.stream.spool import spool_dir
from deepspec.errors import CacheError
from deepspec.log import get_logger

log = get_logger(__name__)


class Producer:
    """One producer's loop; `run()` returns its statistics when the trainer has read its last sample."""

    def __init__(self, cfg, producer: int = 0, producers: int = 1, *, spool: Path | None = None, model=None,
                 device: str | None = None, parent_pid: int | None = None, poll_s: float = 0.05):
        if not 0 <= producer < producers:
            raise CacheError(f"--producer {producer} is outside 0..{producers - 1} (--producers {producers}).")
        self.cfg, self.w, self.n = cfg, producer, producers
        self.spool = spool or spool_dir(cfg)  # this machine's spool folder (the records too, unless in a Mooncake store)
        self.spool.mkdir(parents=True, exist_ok=True)
        # a store's client is sized by the largest record: joined once the plan is made (_run)
        self.channel = FileChannel(self.spool) if cfg.cache.spool_transport == "file" else None
        self.model, self.device, self.parent_pid, self.poll_s = model, device, parent_pid, poll_s
        self.budget = int(cfg.cache.spool_gb * 1e9) // producers
        self.held: dict[int, int] = {}  # index -> bytes of the records this producer wrote that are still there
        self.stats: dict[str, Any] = {"producer": producer, "producers": producers, "pid": os.getpid(), "host": socket.gethostname(),
                                      "produced": 0, "tokens": 0, "bytes": 0, "peak_bytes": 0, "busy_s": 0.0,
                                      "wait_trainer_s": 0.0, "wait_room_s": 0.0, "evicted": 0, "budget_bytes": self.budget}
        self._beat = 0.0

    # ------------------------------------------------------------------ state on disk
    def _heartbeat(self, state: str, force: bool = False) -> None:
        now = time.time()
        if self.channel is not None and (force or now - self._beat > 1.0):
            self._beat = now
            sp.put_json(self.channel, f"producer.{self.w}.json", {**self.stats, "state": state, "time": now})

    def _parent_alive(self) -> bool:
        if self.parent_pid is None:
            return True
        try:
            os.kill(self.parent_pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def _adopt(self) -> None:
        """After a restart: drop our half-written records, count our complete ones (they stay valid). In a store a
        producer's records live in its own segment and left with the process: nothing to adopt."""
        if self.channel.kind != "file":
            return
        self.channel.drop_temporaries(sp.SUFFIX)  # only producers write .rec temporaries; a restarted one replaces its own
        for rec in self.spool.glob(f"*{sp.SUFFIX}"):
            try:
                header, _ = sp.read_record(rec)
            except (FileNotFoundError, CacheError):
                continue
            if header.get("producer") == self.w:
                self.held[int(header["index"])] = rec.stat().st_size

    def _refresh(self) -> None:
        held = list(self.held)
        for i, there in zip(held, self.channel.exists_many([sp.record_name(i) for i in held])):
            if not there:
                del self.held[i]  # read (and deleted) by the trainer

    # ------------------------------------------------------------------ the loop
    def run(self, max_idle_s: float | None = None) -> dict[str, Any]:
        self._heartbeat("starting", force=True)  # a trainer that waits names us from the first second
        try:
            return self._run(max_idle_s)
        except Exception as e:  # noqa: BLE001 - a trainer waiting for this producer's samples stops with this sentence
            self.stats["error"] = str(e)
            raise
        finally:
            self._heartbeat("failed" if "error" in self.stats else "stopped", force=True)

    def _run(self, max_idle_s: float | None) -> dict[str, Any]:

        tokenizer, tconf = load_plan_inputs(self.cfg)
        plan = make_plan(self.cfg, "train", tokenizer, tconf)
        if self.channel is None:
            self.channel = open_channel(self.cfg, self.spool, role="producer", share_bytes=self.budget,
                                        largest_record=sp.largest_record(plan))
            self._heartbeat("starting", force=True)
        doc = self._wait_for_trainer(plan, max_idle_s)
        if doc is None:
            return self.stats
        G = int(doc["global_batch"])
        order = BatchPlan(len(plan.samples), G, G, 1, int(doc["seed"]), doc["bucketing"])
        lengths = [s.length for s in plan.samples]
        featurize, close = make_featurizer(plan, self.cfg, self.device, self.model)
        self._adopt()
        log.info("producer %d of %d: %d samples planned, spool %s, %s of its %s cap", self.w, self.n,
                 len(plan.samples), self.channel.where, _size(self.budget), _size(self.cfg.cache.spool_gb * 1e9))
        live = False  # seen this trainer before its end: a run already finished when we came is not ours to end
        try:
            while True:
                fresh = sp.get_json(self.channel, sp.PLAN)
                if fresh is not None and fresh.get("started") != doc.get("started"):  # the trainer restarted
                    sp.check_plan(fresh, plan, self.channel.where)
                    doc, live = fresh, False
                if not self._parent_alive():
                    break
                if self._trainer_done(doc):
                    if not live:
                        self._idle("the trainer's run had finished: waiting for the next one")
                        continue
                    for i in list(self.held):  # nothing of ours will be read any more
                        self.channel.delete(sp.record_name(i))
                        del self.held[i]
                    if self.cfg.cache.spool_keep:
                        self._complete_kept(plan, featurize, tokenizer, tconf)
                    break
                live = True
                cursors = sp.trainer_cursors(self.channel, int(doc["world"])) or sp.start_cursors(doc)
                if cursors is None:
                    self._idle("waiting for the trainer's position")
                    continue
                self._refresh()
                want = self._window(order, lengths, cursors, int(doc["total_steps"]))
                there = self.channel.exists_many([sp.record_name(i) for _, i in want])
                missing = [(k, i) for (k, i), ok in zip(want, there) if not ok]
                # a record gone since the cursors were read may have been consumed: the reader publishes its next
                # position before it deletes, so cursors read after the existence checks tell
                cursors = sp.trainer_cursors(self.channel, int(doc["world"])) or cursors
                G, world = order.global_batch, len(cursors)
                missing = [(k, i) for k, i in missing if k >= cursors[k % G % world]]
                if self.cfg.cache.spool_keep:  # kept from an earlier read: linked back, no target forward
                    missing = [(k, i) for k, i in missing if not self._restore(i)]
                todo = self._fit(missing, want, plan) if missing else []
                if not todo:
                    self._idle("ahead of the trainer" if not missing else "waiting for room in the spool", room=bool(missing))
                    continue
                t0 = time.monotonic()
                self._produce(plan, todo, featurize, tokenizer)
                self.stats["busy_s"] += time.monotonic() - t0
                self._heartbeat("producing")
        finally:
            close()
        return self.stats

    def _wait_for_trainer(self, plan, max_idle_s: float | None) -> dict[str, Any] | None:
        t0 = time.monotonic()
        while True:
            doc = sp.get_json(self.channel, sp.PLAN)
            if doc is not None:
                sp.check_plan(doc, plan, self.channel.where)
                return doc
            if not self._parent_alive() or (max_idle_s is not None and time.monotonic() - t0 > max_idle_s):
                return None
            self._heartbeat("waiting for a trainer")
            time.sleep(self.poll_s)

    def _trainer_done(self, doc: dict[str, Any]) -> bool:
        return all(self.channel.exists_many([f"{sp.DONE}.{r}" for r in range(int(doc["world"]))]))

    def _idle(self, state: str, room: bool = False) -> None:
        self.stats["wait_room_s" if room else "wait_trainer_s"] += self.poll_s
        self._heartbeat(state)
        time.sleep(self.poll_s)

    def _window(self, order, lengths: list[int], cursors: list[int], total_steps: int) -> list[tuple[int, int]]:
        """(plan position, sample index) of this producer's share of the next `stream_ahead` steps that the trainer has
        yet to read, in the order it reads them (a sample's next use only)."""
        G, world, seen, out = order.global_batch, len(cursors), set(), []
        first = min(cursors) // G
        for step in range(first, min(first + self.cfg.cache.stream_ahead, total_steps)):
            for j, i in enumerate(order.read_order(step, lengths)):
                k = step * G + j
                if k >= cursors[j % world] and k % self.n == self.w and i not in seen:
                    seen.add(i)
                    out.append((k, i))
        return out

    def _restore(self, index: int) -> bool:
        from deepspec.data.stream.keep import restore

        nb = restore(self.spool, index)
        if nb:
            self.held[index] = nb
            self.stats["restored"] = self.stats.get("restored", 0) + 1
        return nb > 0

    def _complete_kept(self, plan, featurize, tokenizer, tconf) -> None:
        """After the trainer's last read: make this producer's share of the samples it never read straight into kept/,
        then (producer 0) write every kept record as the offline train cache once the others are done too."""
        from deepspec.data.stream.keep import kept_path, write_cache

        kept = self.spool / sp.KEPT
        kept.mkdir(exist_ok=True)
        todo = [i for i in range(len(plan.samples)) if i % self.n == self.w and not kept_path(self.spool, i).exists()]
        self._heartbeat("making the samples the trainer never read, for the kept cache", force=True)
        for a in range(0, len(todo), 64):
            self._produce(plan, todo[a : a + 64], featurize, tokenizer, into=FileChannel(kept))
        if self.w != 0:
            return
        while not all(kept_path(self.spool, i).exists() for i in range(len(plan.samples))):
            if not self._parent_alive():
                return
            self._idle("waiting for the other producers' kept samples")
        self._heartbeat("writing the kept cache", force=True)
        if os.environ.get("DEEPSPEC_FAULT_KEEP_DELAY_S"):  # fault injection for tests: a cache that takes a while to write
            time.sleep(float(os.environ["DEEPSPEC_FAULT_KEEP_DELAY_S"]))
        write_cache(self.cfg, plan, self.spool, tconf)

    def _fit(self, missing: list[tuple[int, int]], want: list[tuple[int, int]], plan) -> list[int]:
        """The next missing samples, in plan order, that fit this producer's share of the cap (one batch's worth of
        tokens at most); makes room by deleting its records furthest ahead (or no longer wanted) when the first
        one does not fit."""
        rank = {i: k for k, i in want}
        todo, tokens, pending = [], 0, 0
        for k, i in missing:
            s = plan.samples[i]
            nb = sp.record_file_bytes(s.length, plan.n_layers, plan.hidden_size, plan.dtype)
            if nb > self.budget:
                raise CacheError(
                    f"Sample {s.id!r} needs {_size(nb)} in the spool but each of the {self.n} producer(s) may hold "
                    f"{_size(self.budget)} (cache.spool_gb={self.cfg.cache.spool_gb:g} / producers); raise cache.spool_gb.")
            if todo and tokens + s.length > self.cfg.cache.batch_tokens:
                break
            while sum(self.held.values()) + pending + nb > self.budget:
                later = [j for j in self.held if rank.get(j, float("inf")) > k]
                if not later:
                    return todo
                victim = max(later, key=lambda j: rank.get(j, float("inf")))
                self.channel.delete(sp.record_name(victim))
                del self.held[victim]
                self.stats["evicted"] += 1
            todo.append(i)
            tokens += s.length
            pending += nb
        return todo

    def _produce(self, plan, todo: list[int], featurize, tokenizer, into=None) -> None:
        samples = materialize(plan, [plan.samples[i] for i in todo], tokenizer)
        index_of = {id(s): i for s, i in zip(samples, todo)}
        for batch in length_batches(sorted(samples, key=lambda s: len(s.input_ids)), self.cfg.cache.batch_tokens):
            for sample, feats in featurize(batch):
                self._write(plan, index_of[id(sample)], sample, encode_sample(sample, feats, plan.dtype), into)

    def _write(self, plan, index: int, sample: Sample, data: bytes, into=None) -> None:
        """Into the spool (counted in this producer's share), or `into` another channel (kept/: outside the cap)."""
        nb = sp.write_record(into or self.channel, index, sample.id, data, length=len(sample.input_ids), n_layers=plan.n_layers,
                             hidden=plan.hidden_size, dtype=plan.dtype, truncated=sample.truncated, producer=self.w)
        if into is None:
            self.held[index] = nb
        self.stats["produced"] += 1
        self.stats["tokens"] += len(sample.input_ids)
        self.stats["bytes"] += nb
        self.stats["peak_bytes"] = max(self.stats["peak_bytes"], sum(self.held.values()))


_TORCHRUN_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                  "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"}


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1e3:.1f} kB"


def start_local_producers(cfg, spool: Path, count: int) -> list[subprocess.Popen]:
    """`cache.stream_producers` producers on this machine, children of this trainer process (they exit when it does),
    each logging to <spool>/producer.<w>.log. The recipe travels as the resolved config, so they plan what it plans."""
    from deepspec.config import save_config
    from deepspec.data.cache.guards import check_workers

    check_workers(cfg, count)  # target.device_map spreads one target over the node: one producer, not N
    recipe = save_config(cfg, spool, "recipe.yaml")
    # not a torchrun worker: vLLM and the device choice must not read the trainer's rank variables
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    procs = []
    for w in range(count):
        cmd = [sys.executable, "-m", "deepspec.cli", "data", "stream", str(recipe), "--producer", str(w), "--producers",
               str(count), "--parent-pid", str(os.getpid())]
        log_file = open(spool / f"producer.{w}.log", "ab")
        procs.append(subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, env=env))
        log_file.close()
    log.info("started %d local producer(s) for %s (logs: %s/producer.*.log)", count, spool, spool)
    return procs


def stop_local_producers(procs: list[subprocess.Popen], grace_s: float | None = 30.0) -> None:
    """Wait for the producers to finish (at most `grace_s`, None: as long as they take), then stop them."""
    deadline = None if grace_s is None else time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=None if deadline is None else max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
