"""The spool of streamed training (`cache.mode: stream`): a bounded folder of one-sample records between capture
producers (`deepspec data stream`) and the trainers, so a run needs no cache the size of its data.

Layout of a spool (one folder on local disk or a filesystem every node mounts, or the same names in a Mooncake
store across nodes: channel.py, cache.spool_transport):

* ``plan.json`` — written by the trainer (rank 0) when it starts: the sample plan's signature (target, taps, stream
  reduction, dtype, data hash...), the hash of its sample ids and lengths, and the batch plan (seed, global batch,
  steps). A producer builds the same plan from the same recipe and refuses to produce for another one.
* ``pos.<rank>`` — each trainer rank's next plan position (position k = step × global batch + place in the step's
  read order; rank r reads the places r, r + world, ...). Producers make the samples of the next `stream_ahead` steps
  that some rank has yet to read, in the order they are read; a trainer that resumes from a checkpoint publishes an
  earlier position, and what it needs again is made again.
* ``<index>.rec`` — one sample: a short JSON header (its plan index, id, tokens, layers, width, dtype, producer),
  then the cache's own record encoding (deepspec/data/cache/format.py), read with the cache's own views. Written
  under a temporary name and renamed when complete, so a killed producer never leaves a record a trainer trusts.
  The rank that reads a record deletes it (or, with `cache.spool_keep`, moves it to ``kept/``: keep.py).
* ``producer.<w>.json`` — each producer's heartbeat: what it made, the spool bytes it holds and its peak, how long
  it waited for the trainer or for room.
* ``ledger.<rank>.jsonl`` — every record a rank read (index, id, and the step it is read for): what was trained,
  countable after the fact (always a file, in the rank's own spool folder). Lines of steps after the last checkpoint
  are provisional: a run killed there read records it never trained, and its resume drops those lines
  (`commit_ledgers`) before it reads them again, so the ledgers count each record once per epoch across crashes.
* ``done.<rank>`` — the rank read its last record (with its read count and how long it waited for producers);
  producers exit when every rank is done.

The cap (`cache.spool_gb`) is split evenly between producers and each one counts the records it wrote and its
record in progress, so the folder never holds more than the cap. When a producer's share is full and the record
the trainer needs next does not fit, it deletes its records furthest ahead in the plan (they are made again later)
instead of waiting for a trainer that is waiting for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
import zlib
from collections import deque
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from deepspec.data.cache import format as fmt
from deepspec.data.stream.channel import FileChannel
from deepspec.errors import CacheError
from deepspec.log import get_logger
from deepspec import preemption

log = get_logger(__name__)

MAGIC = b"DSSPOOL1"
PLAN = "plan.json"
DONE = "done"
SUFFIX = ".rec"
KEPT = "kept"  # cache.spool_keep: read records move here (deepspec/data/stream/keep.py writes the cache from them)
_HEADER_ROOM = 512  # the JSON header is padded to this many bytes, so records start aligned


def spool_dir(cfg) -> Path:
    """cache.spool_dir, else <cache.dir>/spool/<run name>: one spool per run."""
    return Path(cfg.cache.spool_dir) if cfg.cache.spool_dir else cfg.cache_dir / "spool" / cfg.run_name


def record_name(index: int) -> str:
    return f"{index}{SUFFIX}"


def record_path(spool: Path, index: int) -> Path:
    return spool / record_name(index)


def record_file_bytes(length: int, n_layers: int, hidden: int, dtype: str) -> int:
    return len(MAGIC) + _HEADER_ROOM + fmt.record_nbytes(length, n_layers, hidden, dtype)


def largest_record(plan) -> int:
    """Bytes of the plan's largest record: what a store client must be able to stage at once."""
    return max(record_file_bytes(s.length, plan.n_layers, plan.hidden_size, plan.dtype) for s in plan.samples)


def write_record(channel, index: int, sample_id: str, data: bytes, *, length: int, n_layers: int, hidden: int,
                 dtype: str, truncated: bool, producer: int) -> int:
    """Put one encoded record (all or nothing: a folder's is written under a temporary name, fsynced and renamed);
    returns its bytes."""
    header = json.dumps({"index": index, "id": sample_id, "length": length, "n_layers": n_layers, "hidden": hidden,
                         "dtype": dtype, "nbytes": len(data), "crc32": zlib.crc32(data), "truncated": bool(truncated),
                         "producer": producer}).encode()
    if len(header) >= _HEADER_ROOM:
        raise CacheError(f"The spool header of sample {sample_id!r} is {len(header)} bytes (limit {_HEADER_ROOM}); shorten the sample id.")
    blob = MAGIC + header.ljust(_HEADER_ROOM, b" ") + data
    channel.put(record_name(index), blob, durable=True, what="the streamed record")
    return len(blob)


def parse_record(blob: bytes | bytearray, where: str, verify: bool = False) -> tuple[dict[str, Any], bytearray]:
    """(header, record bytes) of a spool record's bytes; `where` names it in errors."""
    blob = blob if isinstance(blob, bytearray) else bytearray(blob)
    if blob[: len(MAGIC)] != MAGIC or len(blob) < len(MAGIC) + _HEADER_ROOM:
        raise CacheError(f"{where} is not a deepspec spool record; remove it (the producer makes it again).")
    header = json.loads(bytes(blob[len(MAGIC) : len(MAGIC) + _HEADER_ROOM]).decode())
    data = blob[len(MAGIC) + _HEADER_ROOM :]
    if len(data) != header["nbytes"]:
        raise CacheError(f"{where} holds {len(data)} record bytes, its header says {header['nbytes']}; remove it (it is made again).")
    if verify and zlib.crc32(data) != header["crc32"]:
        raise CacheError(f"{where} fails its checksum; remove it (it is made again).")
    return header, data


def read_record(path: Path, verify: bool = False) -> tuple[dict[str, Any], bytearray]:
    """(header, record bytes) of a record file; raises FileNotFoundError while it is not there."""
    with open(path, "rb") as f:
        return parse_record(bytearray(f.read()), str(path), verify)


def plan_hash(plan) -> str:
    """Identifies a sample plan: its ids and lengths in order (the signature says how they were made)."""
    h = hashlib.sha256()
    for s in plan.samples:
        h.update(f"{s.id}\t{s.length}\n".encode())
    return h.hexdigest()[:16]


def plan_document(plan, *, seed: int, global_batch: int, total_steps: int, bucketing: str) -> dict[str, Any]:
    return {"signature": plan.signature, "samples": len(plan.samples), "samples_hash": plan_hash(plan), "seed": seed,
            "global_batch": global_batch, "total_steps": total_steps, "bucketing": bucketing, "host": socket.gethostname(), "pid": os.getpid(),
            "started": time.time()}


def check_plan(doc: dict[str, Any], plan, spool: str) -> None:
    """Refuse to produce for a trainer whose samples or features differ from this producer's recipe."""
    mine = plan.signature
    diff = [k for k in sorted(set(mine) | set(doc["signature"])) if mine.get(k) != doc["signature"].get(k)]
    if diff:
        k = diff[0]
        raise CacheError(f"The trainer of {spool} planned {k}={doc['signature'].get(k)!r} but this producer's recipe gives "
                         f"{mine.get(k)!r}; start the producer with the trainer's recipe and --opts.")
    if doc["samples_hash"] != plan_hash(plan):
        raise CacheError(f"The trainer of {spool} plans other samples than this producer ({doc['samples']} vs {len(plan.samples)}); "
                         "the regenerated data changed — give both the same data.")


def put_json(channel, name: str, data: Any) -> None:
    channel.put(name, json.dumps(data).encode())


def get_json(channel, name: str) -> dict[str, Any] | None:
    blob = channel.get(name)
    try:
        return None if blob is None else json.loads(blob)
    except json.JSONDecodeError:
        return None


def trainer_cursors(channel, world: int) -> list[int] | None:
    """Each trainer rank's next plan position (None until every rank has said): rank r reads the positions k with
    k % global_batch % world == r, and has consumed its ones before its cursor."""
    cursors = []
    for r in range(world):
        blob = channel.get(f"pos.{r}")
        try:
            cursors.append(int(blob))
        except (TypeError, ValueError):
            return None
    return cursors


def start_cursors(doc: dict[str, Any]) -> list[int] | None:
    """Each rank's first plan position, from the plan's start step, before the ranks have published their own (rank r
    reads positions k % global_batch % world == r, the first of them at start_step * global_batch + r); None for a
    plan written without it."""
    if doc.get("start_step") is None:
        return None
    G, world = int(doc["global_batch"]), int(doc["world"])
    return [int(doc["start_step"]) * G + r for r in range(world)]


def commit_ledgers(folder: Path, start_step: int) -> int:
    """Drop the ledger lines (of every rank's ledger in `folder`) read for steps >= `start_step`, the step training
    resumes at: their records were read before a crash or a preemption, never trained into a checkpoint, and are
    read again. Atomic per file and idempotent (the ranks of one node may all run it). Returns the lines dropped."""
    dropped = 0
    for path in sorted(folder.glob("ledger.*.jsonl")):
        lines = path.read_text().splitlines(keepends=True)
        keep = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", -1) < start_step]
        if len(keep) == len(lines):
            continue
        dropped += len(lines) - len(keep)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
    return dropped


def heartbeats(channel) -> list[dict[str, Any]]:
    """Every producer's last heartbeat."""
    return [b for n in channel.names("producer.", ".json") if (b := get_json(channel, n)) is not None]


class SpoolDataset:
    """The training samples of a streamed run: `dataset[i]` waits for sample i's record in the spool, reads it as the
    cache reader reads a record (same item layout), deletes it and notes it in this rank's ledger.

    The trainer's loader hands it the schedule first (`follow`), so each read knows its plan position and publishes
    it: the producers know what to make next. A read that waits gives up when training is preempted (`waits`:
    deepspec/preemption.py), so a paused or lost producer never holds a SIGTERM until the launcher's SIGKILL."""

    supports_worker_processes = False  # one reader per rank: it owns the deletes and the ledger
    waits = True  # a read may wait for a producer: a preempted trainer must stop waiting (deepspec/preemption.py)

    def __init__(self, channel, plan, *, global_batch: int, rank: int, world: int, taps: Sequence[int], rows: int,
                 local: str | Path, timeout_s: float = 1800.0, poll_s: float = 0.05, keep: bool = False):
        self.channel = channel
        self.local = Path(local)  # this rank's own folder: its ledger
        self.keep = keep  # move read records to kept/ (deepspec/data/stream/keep.py) instead of deleting them
        self.global_batch = global_batch
        self.plan = plan
        self.rank, self.world = rank, world
        self.taps, self.rows = list(taps), rows
        self.hidden_size = plan.hidden_size
        self.dtype = plan.dtype
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.lengths = np.array([s.length for s in plan.samples], dtype=np.int64)
        self.manifest = dict(plan.signature)
        self._ledger = None
        self._expect: deque[tuple[int | None, int | None]] = deque()  # (plan position, index) of the reads to come
        self._lock = threading.Lock()
        self.waited_s = 0.0  # time this rank's reads waited for producers (the trainer's stall, when it prefetches)
        self.reads = 0
        self.done = False  # this rank has read its last sample (its done mark is out)

    def __len__(self) -> int:
        return len(self.plan.samples)

    def sample_id(self, i: int) -> str:
        return self.plan.samples[i].id

    def token_counts(self):
        import torch

        if self.plan.token_counts is None:
            raise CacheError("This stream plan was made without token counts; it cannot size a draft vocabulary.")
        return torch.from_numpy(self.plan.token_counts)

    def follow(self, schedule: Iterator[tuple[int, int, list[int]]]) -> Iterator[tuple[int, int, list[int]]]:
        """Pass the loader's schedule through, remembering each read's plan position: within a step this rank reads
        positions rank, rank + world, ... of the step's read order (BatchPlan.read_order), micro-batch after
        micro-batch. `__getitem__` publishes them; `done.<rank>` follows the last read."""
        last, n = None, 0
        for step, m, idx in schedule:
            if step != last:
                last, n = step, 0
            with self._lock:
                for i in idx:
                    self._expect.append((step * self.global_batch + self.rank + n * self.world, i))
                    n += 1
            yield step, m, idx
        with self._lock:
            if self._expect:
                self._expect.append((None, None))  # the read that empties the queue says done
            else:
                self._finish()

    def _position(self, i: int) -> int | None:
        """The plan position of this read (None outside the schedule: tests, inspection). Its entry stays queued
        until the read completes, so the end of the schedule is never declared while a read still waits."""
        with self._lock:
            if not self._expect or self._expect[0][1] is None:
                return None
            k, j = self._expect[0]
        if j != i:
            raise CacheError(f"internal: the loader read sample {i} where its schedule says {j}")
        return k

    def _publish(self, k: int) -> None:
        """pos.<rank> = the plan position of this rank's next read: every position before it is consumed."""
        self.channel.put(f"pos.{self.rank}", str(k).encode())

    def _linger_then_close(self, timeout_s: float = 30.0) -> None:
        """After this rank's last read, with a store: its done mark lives in this process's memory, so keep the client
        until every producer has seen it and stopped (at most `timeout_s`), then leave the store."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            try:
                if all(b.get("state") in ("stopped", "failed") for b in heartbeats(self.channel)):
                    break
            except Exception:  # noqa: BLE001 - the store went away: nothing left to wait for
                break
            time.sleep(0.2)
        self.close()

    def linger(self) -> None:
        """At exit: let the producers see this rank's done mark before the process (and a store's copy) goes."""
        thread = getattr(self, "_lingering", None)
        if thread is not None:
            thread.join(timeout=40.0)

    def _finish(self) -> None:
        self.done = True
        done = {"rank": self.rank, "reads": self.reads, "waited_s": round(self.waited_s, 3)}
        put_json(self.channel, f"{DONE}.{self.rank}", done)
        if self.channel.kind != "file":  # a store's copy leaves with this process: keep one here, and stay a while
            (self.local / f"{DONE}.{self.rank}").write_text(json.dumps(done))
            self._lingering = threading.Thread(target=self._linger_then_close, name="spool-linger", daemon=True)
            self._lingering.start()

    def __getitem__(self, i: int) -> dict[str, Any]:
        k = self._position(i)
        if k is not None:
            self._publish(k)
        name = record_name(i)
        t0, warned, said = time.monotonic(), 0.0, 0.0
        while True:
            blob = self.channel.get(name)
            if blob is not None:
                header, data = parse_record(blob, f"{self.channel.where}/{name}")
                break
            waited = time.monotonic() - t0
            if waited > self.timeout_s:
                raise CacheError(self._stalled(i, waited))
            if preemption.pending():  # SIGTERM / SIGUSR1: the ranks agree and checkpoint their last finished step
                raise preemption.WaitPreempted(f"rank {self.rank} stopped waiting for sample {i} from the spool")
            if waited - said > 1:
                self._fail_if_a_producer_failed()
            if waited - said > 1 and k is not None:  # a producer that (re)starts while we wait finds us
                said = waited
                self._publish(k)
            if waited - warned > 30:
                warned = waited
                log.warning("rank %d: waiting %.0f s for sample %d from the producers: %s", self.rank, waited, i, self._producers())
            time.sleep(self.poll_s)
        self.waited_s += time.monotonic() - t0
        self.reads += 1
        sample = self.plan.samples[i]
        if header["index"] != i or header["id"] != sample.id or header["length"] != sample.length:
            raise CacheError(f"{self.channel.where}/{name} holds sample {header['id']!r} ({header['length']} tokens), the plan "
                             f"says {sample.id!r} ({sample.length}); the spool is shared with another run — give each run its own "
                             "cache.spool_dir (or run.name).")
        if k is not None:  # before the delete: a producer that then finds the record gone also finds it consumed
            self._publish(k + 1)
        if self.keep:
            consume(record_path(self.channel.folder, i), True, blob)
        else:
            self.channel.delete(name)
        self._note(i, header, None if k is None else k // self.global_batch)
        if k is not None:
            with self._lock:
                self._expect.popleft()
                if self._expect and self._expect[0][1] is None:
                    self._expect.popleft()
                    self._finish()
        return fmt.record_item(data, 0, sample.length, len(self.taps), self.rows, self.hidden_size, self.dtype)

    def _note(self, i: int, header: dict[str, Any], step: int | None) -> None:
        """One ledger line; `step` (the step it is read for) lets a resume drop what was read but never trained."""
        if self._ledger is None:
            self._ledger = open(self.local / f"ledger.{self.rank}.jsonl", "a")
        line = {"index": i, "id": header["id"], "producer": header["producer"]}
        self._ledger.write(json.dumps(line if step is None else {**line, "step": step}) + "\n")
        self._ledger.flush()

    def _fail_if_a_producer_failed(self) -> None:
        """A producer that stopped on an error (not one that was killed: that one is restarted) leaves its share of the
        samples unmade for good: stop now with its sentence rather than after cache.stream_timeout_s."""
        for b in heartbeats(self.channel):
            if b.get("state") == "failed":
                raise CacheError(f"Producer {b.get('producer')} of the spool {self.channel.where} stopped: {b.get('error')} "
                                 f"(its log: producer.{b.get('producer')}.log there, or its terminal). Fix that and rerun "
                                 "training with the producers: it resumes from its last checkpoint.")

    def _producers(self) -> str:
        beats = heartbeats(self.channel)
        if not beats:
            return "no producer has started; start `deepspec data stream CONFIG` with this run's recipe and --opts"
        now, parts = time.time(), []
        for b in beats:
            parts.append(f"producer {b.get('producer', '?')} (pid {b.get('pid', '?')} on {b.get('host', '?')}, {b.get('state', '?')}) "
                         f"last seen {now - b.get('time', 0):.0f} s ago, {b.get('produced', 0)} made")
        return "; ".join(parts)

    def _stalled(self, i: int, waited: float) -> str:
        return (f"Sample {i} ({self.sample_id(i)!r}) did not reach the spool {self.channel.where} in {waited:.0f} s "
                f"(cache.stream_timeout_s): {self._producers()}. Restart the producers (`deepspec data stream CONFIG`), then "
                "rerun training: it resumes from its last checkpoint.")

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None
        self.channel.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_ledger"] = None
        state["_lingering"] = None
        state["_expect"] = deque()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def consume(path: Path, keep: bool, blob: bytes | None = None) -> None:
    """A record the trainer has read: deleted, or moved to kept/ (once: a copy already kept is the same bytes).
    `blob`: the bytes the trainer read. Once it has published its next position a producer may take the file as no
    longer wanted and evict it before this move; the kept copy is then written from those bytes."""
    if keep:
        dst = path.parent / KEPT / path.name
        dst.parent.mkdir(exist_ok=True)
        if not dst.exists():
            try:
                os.replace(path, dst)
            except FileNotFoundError:
                if blob is None:
                    raise
                FileChannel(dst.parent).put(dst.name, blob, durable=True, what="the kept record")
            return
    path.unlink(missing_ok=True)
