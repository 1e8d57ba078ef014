"""Building a cache: plan (tokenize + split into shards), capture (run the target), finalize.

Why a plan first: tokenizing is cheap next to the target forward, and knowing every sample's
length up front fixes the shard boundaries as a pure function of (data, settings). So
  * `--estimate` is exact and writes nothing;
  * N workers can take shards i ≡ rank (mod N) and still produce the very cache a single
    worker does (same shards, same batches inside each shard);
  * a rerun after a crash skips every shard whose index file exists (a shard's `.bin` is
    renamed into place before its index is written, so an index implies a complete shard).
The manifest is written last, atomically; until then `is_complete` is False.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from deepspec import __version__
from deepspec.data.cache import format as fmt
from deepspec.data.cache.guards import check_size, check_workers
from deepspec.cpus import threads_per_worker
from deepspec.diskfull import room_for
from deepspec.data.chat import render_conversation
from deepspec.errors import CacheError, DataError
from deepspec.hashing import file_sha256
from deepspec.log import get_logger, progress
from deepspec.targets.load import resolve_dtype_name
from deepspec.preemption import Preempted, fault_point, stop_on_signals

log = get_logger(__name__)


@dataclass
class Sample:
    """One conversation to capture. The plan keeps only where it is and how long it is (so a plan of
    millions of samples stays small and cheap to hand to workers); tokens are re-rendered per shard."""

    id: str
    input_ids: np.ndarray | None  # int32 [T] (None until materialized)
    loss_mask: np.ndarray | None  # uint8 [T]
    truncated: bool
    length: int = 0
    offset: int = -1  # byte offset of its line in the input JSONL

    def __post_init__(self) -> None:
        if self.input_ids is not None:
            self.length = len(self.input_ids)


@dataclass
class Plan:
    """Everything a worker needs, fixed before any target forward."""

    signature: dict[str, Any]
    samples: list[Sample]
    shards: list[tuple[int, int]]  # [start, end) into samples
    counts: dict[str, int]
    n_layers: int  # stored feature rows per token = n_taps + 1
    hidden_size: int
    vocab_size: int
    dtype: str
    meta: dict[str, Any] = field(default_factory=dict)
    token_counts: np.ndarray | None = None  # loss-masked [V] counts, when asked for (streamed runs: no shard counts them)

    def shard_bytes(self, s: int) -> int:
        a, b = self.shards[s]
        return sum(fmt.record_nbytes(x.length, self.n_layers, self.hidden_size, self.dtype) for x in self.samples[a:b])

    @property
    def total_bytes(self) -> int:
        return sum(self.shard_bytes(s) for s in range(len(self.shards)))


def split_paths(cfg, split: str) -> tuple[Path, Path]:
    if split == "train":
        return cfg.regenerated_path, cfg.cache_train_dir
    if split == "heldout":
        return cfg.regenerated_heldout_path, cfg.cache_heldout_dir
    raise CacheError(f"Unknown cache split {split!r}; use 'train' or 'heldout'.")


def file_hash(path: Path) -> str:
    """Short data hash for the manifest (first 16 hex digits of the file's sha256)."""
    return file_sha256(path)[:16]


def _parse_line(path: Path, lineno: int, line: bytes | str):
    try:
        rec = json.loads(line)
        messages = rec["conversations"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{path}:{lineno} is not a conversation record ({e}); expected {{\"id\", \"conversations\"}}.") from None
    return str(rec.get("id", lineno - 1)), messages


def iter_records(path: Path):
    """Yield (byte offset, id, messages) from regenerated.jsonl; a malformed line is a DataError naming it."""
    with open(path, "rb") as f:
        lineno, offset = 0, 0
        for line in f:
            lineno += 1
            if line.strip():
                sid, messages = _parse_line(path, lineno, line)
                yield offset, sid, messages
            offset += len(line)


def read_conversations(path: Path):
    """Yield (id, messages) from regenerated.jsonl."""
    for _, sid, messages in iter_records(path):
        yield sid, messages


def resolve_taps(cfg, num_layers: int) -> list[int]:
    """The taps to cache: model.target_layer_ids, or the draft algorithm's default for this depth
    (the same rule the draft uses when it is built, so the cache and the draft agree)."""
    from deepspec.errors import ConfigError
    from deepspec.targets.taps import resolve_taps

    count = 3
    if not cfg.model.target_layer_ids:
        try:
            from deepspec.drafts.registry import get_algorithm

            count = int(getattr(get_algorithm(cfg.model.algorithm), "default_num_taps", 3))
        except (ConfigError, ImportError):
            pass
    return resolve_taps(cfg.model.target_layer_ids, num_layers, count)


def tap_rows(cfg, target_config) -> tuple[int, str, int]:
    """(hc_mult, tap_reduction, stored rows of H per tap): a reduced tap of width W = H or S*H is stored as
    W / H rows of H, so the record format is the same for every target (and fp8 scales stay per stream)."""
    from deepspec.targets.adapters import adapter_for
    from deepspec.targets.taps import tap_width

    hc_mult = adapter_for(target_config).hc_mult(target_config)
    reduction = cfg.model.tap_reduction
    return hc_mult, reduction, tap_width(target_config.hidden_size, hc_mult, reduction) // target_config.hidden_size


def count_loss_tokens(counts: np.ndarray, input_ids, loss_mask) -> np.ndarray:
    """Add one sample's loss-masked token ids to `counts` (grown when an id is past its end); returns the counts."""
    lm = np.asarray(input_ids, dtype=np.int64)[np.asarray(loss_mask).astype(bool)]
    if len(lm) and lm.max() >= len(counts):
        counts = np.pad(counts, (0, int(lm.max()) + 1 - len(counts)))
    np.add.at(counts, lm, 1)
    return counts


def _tokenize(src: Path, split: str, tokenizer, cfg, count_vocab: int | None):
    """Render and tokenize every conversation of `src`: (samples kept, counts, loss-token counts when `count_vocab`)."""
    cc = cfg.cache
    samples: list[Sample] = []
    counts = dict(input=0, dropped_short=0, truncated=0, samples=0, tokens=0, loss_tokens=0)
    token_counts = np.zeros(max(count_vocab, 1), dtype=np.int64) if count_vocab is not None else None
    for offset, sid, messages in progress(iter_records(src), desc=f"tokenize {split}", unit="conv"):
        counts["input"] += 1
        r = render_conversation(tokenizer, messages, cfg.target.chat_template_kwargs, cc.max_length)
        n_loss = sum(r.loss_mask)
        if n_loss < cc.min_loss_tokens:
            counts["dropped_short"] += 1
            continue
        counts["truncated"] += int(r.truncated)
        samples.append(Sample(sid, None, None, r.truncated, length=len(r.input_ids), offset=offset))
        counts["samples"] += 1
        counts["tokens"] += len(r.input_ids)
        counts["loss_tokens"] += n_loss
        if token_counts is not None:
            token_counts = count_loss_tokens(token_counts, r.input_ids, r.loss_mask)
    return samples, counts, token_counts


def make_plan(cfg, split: str, tokenizer, target_config, *, count_tokens: bool = False) -> Plan:
    """Tokenize the split, apply min_loss_tokens / max_length, and cut shards of <= cache.shard_bytes.
    `count_tokens`: also count the loss-masked tokens (what the shards count when a cache is built).
    The tokenized part is shared through the data folder (plan_cache.py): one process of a run tokenizes."""
    from deepspec.data.cache.plan_cache import tokenized, tokenizer_fingerprint
    from deepspec.targets import template_hash

    src, _ = split_paths(cfg, split)
    if not Path(src).is_file():
        raise DataError(f"{src} does not exist; run `deepspec data regenerate` first (or set data.dir).")
    cc = cfg.cache
    taps = resolve_taps(cfg, target_config.num_hidden_layers)
    hidden = target_config.hidden_size
    hc_mult, reduction, rows = tap_rows(cfg, target_config)
    n_layers = len(taps) * rows + 1
    vocab = int(getattr(target_config, "vocab_size", 0) or 0)
    data_sha = file_sha256(Path(src))
    data_hash = data_sha[:16]  # = file_hash(src)
    inputs = {"data_sha": data_sha, "split": split, "tokenizer": tokenizer_fingerprint(tokenizer),
              "template_hash": template_hash(tokenizer), "chat_template_kwargs": cfg.target.chat_template_kwargs,
              "max_length": cc.max_length, "min_loss_tokens": cc.min_loss_tokens, "count_tokens": count_tokens, "vocab": vocab}
    samples, counts, token_counts = tokenized(
        Path(src), split, inputs, lambda: _tokenize(Path(src), split, tokenizer, cfg, vocab if count_tokens else None))
    if not samples:
        raise DataError(
            f"No sample in {src} has >= cache.min_loss_tokens={cc.min_loss_tokens} assistant tokens "
            f"({counts['input']} read); check the file or lower cache.min_loss_tokens."
        )
    shards: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, s in enumerate(samples):
        nb = fmt.record_nbytes(s.length, n_layers, hidden, cc.dtype)
        if i > start and size + nb > cc.shard_bytes:
            shards.append((start, i))
            start, size = i, 0
        size += nb
    shards.append((start, len(samples)))
    signature = {
        "format_version": fmt.FORMAT_VERSION,
        "split": split,
        "target": cfg.target.name,
        "target_revision": cfg.target.revision,
        "target_dtype": resolve_dtype_name(cfg.target.dtype, os.environ.get("DEEPSPEC_CACHE_DEVICE")),
        "template_hash": template_hash(tokenizer),
        "chat_template_kwargs": dict(cfg.target.chat_template_kwargs or {}),
        "taps": taps,
        "hidden_size": hidden,
        "hc_mult": hc_mult,
        "tap_reduction": reduction,
        "dtype": cc.dtype,
        "max_length": cc.max_length,
        "min_loss_tokens": cc.min_loss_tokens,
        "shard_bytes": cc.shard_bytes,
        "batch_tokens": cc.batch_tokens,
        "capture_backend": cc.capture_backend,
        "data_hash": data_hash,
    }
    meta = {"data_path": str(src), "chat_template_kwargs": dict(cfg.target.chat_template_kwargs or {}), "max_length": cc.max_length}
    return Plan(signature, samples, shards, counts, n_layers, hidden, vocab, cc.dtype, meta=meta, token_counts=token_counts)


def materialize(plan: Plan, samples: list[Sample], tokenizer) -> list[Sample]:
    """Re-render the token ids and loss masks of planned samples from the input file."""
    path = Path(plan.meta["data_path"])
    out = []
    with open(path, "rb") as f:
        for s in samples:
            f.seek(s.offset)
            sid, messages = _parse_line(path, -1, f.readline())
            r = render_conversation(tokenizer, messages, plan.meta["chat_template_kwargs"], plan.meta["max_length"])
            if sid != s.id or len(r.input_ids) != s.length:
                raise DataError(f"{path} changed while the cache was being built (sample {s.id!r}); rerun with --overwrite.")
            out.append(Sample(sid, np.asarray(r.input_ids, np.int32), np.asarray(r.loss_mask, np.uint8), r.truncated, offset=s.offset))
    return out


def estimate(plan: Plan) -> dict[str, Any]:
    total = plan.total_bytes
    return {
        "split": plan.signature["split"],
        "samples": plan.counts["samples"],
        "tokens": plan.counts["tokens"],
        "dropped_short": plan.counts["dropped_short"],
        "truncated": plan.counts["truncated"],
        "shards": len(plan.shards),
        "dtype": plan.dtype,
        "bytes": total,
        "bytes_per_token": total / max(1, plan.counts["tokens"]),
        "gib": round(total / 2**30, 4),
    }


# ---------------------------------------------------------------------------------- capture


def length_batches(samples: list[Sample], batch_tokens: int) -> list[list[Sample]]:
    """Consecutive samples whose padded size (n * longest) stays <= batch_tokens (>= 1 sample)."""
    out: list[list[Sample]] = []
    cur: list[Sample] = []
    longest = 0
    for s in samples:
        t = len(s.input_ids)
        if cur and (len(cur) + 1) * max(longest, t) > batch_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(s)
        longest = max(longest, t)
    if cur:
        out.append(cur)
    return out


def device_features(model, batch: list[Sample], taps: list[int], reduction: str = "mean"):
    """Run the target on a right-padded batch: features [B, T, n_taps * rows + 1, H] where the target computed them
    (its device, its dtype), each tap reduced by `reduction` to W = rows * H and stored as its `rows` slices of H
    (rows = 1 unless concat). Rows past a sample's length are the target's output for padding, not zeros."""
    import torch

    from deepspec.targets import capture

    device = next(model.parameters()).device
    T = max(len(s.input_ids) for s in batch)
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    att = torch.zeros(len(batch), T, dtype=torch.long)
    for b, s in enumerate(batch):
        ids[b, : len(s.input_ids)] = torch.from_numpy(s.input_ids.astype(np.int64))
        att[b, : len(s.input_ids)] = 1
    # No mask for a single sample: the exact computation HF does for an unpadded sequence.
    mask = att.to(device) if len(batch) > 1 else None
    tap_h, final = capture(model, ids.to(device), taps, attention_mask=mask, reduction=reduction)
    B, T, n, W = tap_h.shape
    H = final.shape[-1]
    return torch.cat([tap_h.reshape(B, T, n * W // H, H), final.unsqueeze(2)], dim=2)


def sample_features(model, batch: list[Sample], taps: list[int], reduction: str = "mean"):
    """`device_features` per sample, on the host in float32: yields (sample, features [T, n_taps * rows + 1, H])."""
    feats = device_features(model, batch, taps, reduction).float().cpu()
    for b, s in enumerate(batch):
        yield s, feats[b, : len(s.input_ids)]


def stored_features(model, batch: list[Sample], taps: list[int], reduction: str, dtype: str):
    """`device_features` converted to the cache's storage dtype where the target computed them (bf16: half the
    float32 bytes cross to the host, fp8: about a quarter), copied asynchronously into page-locked memory on CUDA:
    yields (sample, Stored) whose bytes equal `encode_record` of `sample_features`' output."""
    import torch

    stored, scales = fmt.to_storage(device_features(model, batch, taps, reduction), dtype)
    ready = None
    if stored.device.type == "cuda":
        with torch.cuda.device(stored.device):
            host = torch.empty(stored.shape, dtype=stored.dtype, pin_memory=True)
            host.copy_(stored, non_blocking=True)
            if scales is not None:
                host_scales = torch.empty(scales.shape, dtype=scales.dtype, pin_memory=True)
                scales = host_scales.copy_(scales, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(stored.device))
        stored = host
    elif stored.device.type != "cpu":
        stored, scales = stored.cpu(), None if scales is None else scales.cpu()
    for b, s in enumerate(batch):
        n = len(s.input_ids)
        yield s, Stored(stored[b, :n], None if scales is None else scales[b, :n], ready)


def _write_shard(directory: Path, plan: Plan, s: int, featurize, bar, tokenizer) -> None:
    a, b = plan.shards[s]
    samples = materialize(plan, plan.samples[a:b], tokenizer)
    bin_path = directory / fmt.shard_name(s)
    tmp = bin_path.with_name(bin_path.name + ".tmp")
    rows = np.zeros(len(samples), dtype=fmt.INDEX_DTYPE)
    counts = np.zeros(max(plan.vocab_size, 1), dtype=np.int64)
    # Batches of similar lengths: in the file's order a batch pads to its longest sample, and on the
    # quickstart data that meant 2.3x the real tokens through the target (1.1x sorted). Records land
    # in the shard in this order; the index keeps plan order, each row with its record's byte offset.
    row_of = {id(x): j for j, x in enumerate(samples)}
    by_length = sorted(samples, key=lambda x: len(x.input_ids))
    with room_for(bin_path, plan.shard_bytes(s), "the cache shard"):
        counts = _capture_shard(tmp, by_length, plan, s, featurize, bar, rows, counts, row_of)
        commit_shard(directory, s, tmp, counts, rows)


def commit_shard(directory: Path, s: int, tmp: Path, counts: np.ndarray, rows: np.ndarray) -> None:
    """A complete, fsynced shard file into place, then its counts, then its index (last: marks the shard done)."""
    os.replace(tmp, directory / fmt.shard_name(s))
    fmt.write_npy_atomic(directory / f"shard_{s:05d}.counts.npy", counts)
    fmt.write_npy_atomic(directory / f"shard_{s:05d}.idx.npy", rows)


def _capture_shard(tmp: Path, by_length: list[Sample], plan: Plan, s: int, featurize, bar, rows, counts, row_of) -> np.ndarray:
    """Capture a shard's samples into `tmp` (fsynced), filling `rows`; returns the token counts. A failure removes `tmp`.

    This thread runs the target batch after batch; a `_RecordWriter` thread encodes, checksums and appends the
    previous batch meanwhile, in order, so the shard is the same bytes as when one thread did both."""
    try:
        with open(tmp, "wb") as f:
            writer = _RecordWriter(f, plan.dtype, s, rows, counts, row_of)
            try:
                for batch in length_batches(by_length, plan.signature["batch_tokens"]):
                    writer.put(list(featurize(batch)))
                    bar.update(sum(len(x.input_ids) for x in batch))
                    bar.bytes_written += sum(fmt.record_nbytes(len(x.input_ids), plan.n_layers, plan.hidden_size, plan.dtype) for x in batch)
                    bar.set_postfix_str(f"{bar.bytes_written / 2**20:.1f} MiB written")
                    fault_point("cache-batch")
                counts = writer.close()
            finally:
                writer.stop()
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a partial shard is never kept: a rerun rewrites the whole shard
        raise
    return counts


@dataclass
class Stored:
    """One sample's features already in the cache's storage dtype (host tensors [T, L, H], fp8 scales [T, L]), readable
    once `ready` (the CUDA event of their device-to-host copy, None on the host) has completed."""

    features: Any
    scales: Any = None
    ready: Any = None


def encode_sample(sample: Sample, feats, dtype: str) -> bytes:
    """One captured sample's record: features already in the storage dtype (`Stored`, the HF backend) or float
    tensors on the host (the vLLM backend)."""
    if isinstance(feats, Stored):
        if feats.ready is not None:
            feats.ready.synchronize()
        return fmt.encode_stored(sample.input_ids, sample.loss_mask, feats.features, feats.scales, dtype)
    return fmt.encode_record(sample.input_ids, sample.loss_mask, feats, dtype)


class _RecordWriter:
    """Encodes, checksums (crc32) and appends the records of whole batches in a thread, in the order they were put.

    At most `depth` batches wait, so host memory stays bounded while the target's next forward overlaps this work.
    An error in the thread is raised by the next `put` / `close`; `stop` ends the thread after a failure here."""

    def __init__(self, f, dtype: str, shard: int, rows: np.ndarray, counts: np.ndarray, row_of: dict[int, int], depth: int = 2):
        import queue
        import threading

        self.f, self.dtype, self.shard, self.rows, self.counts, self.row_of = f, dtype, shard, rows, counts, row_of
        self.offset = 0
        self.error: BaseException | None = None
        self.stopping = False
        self.queue: Any = queue.Queue(maxsize=depth)
        self.thread = threading.Thread(target=self._run, name="cache-writer", daemon=True)
        self.thread.start()

    def _put(self, item) -> None:
        import queue

        while True:
            if self.error is not None:
                raise self.error
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def put(self, records: list[tuple[Sample, Any]]) -> None:
        self._put(records)

    def _run(self) -> None:
        try:
            while True:
                records = self.queue.get()
                if records is None or self.stopping:
                    return
                for sample, feats in records:
                    self._write(sample, feats)
        except BaseException as e:  # noqa: BLE001 - handed to the capturing thread
            self.error = e

    def _write(self, sample: Sample, feats) -> None:
        data = encode_sample(sample, feats, self.dtype)
        self.f.write(data)
        n_loss = int(sample.loss_mask.sum())
        self.rows[self.row_of[id(sample)]] = (self.shard, self.offset, len(sample.input_ids), len(data), zlib.crc32(data), n_loss,
                                              int(sample.truncated))
        self.counts = count_loss_tokens(self.counts, sample.input_ids, sample.loss_mask)
        self.offset += len(data)

    def close(self) -> np.ndarray:
        """Wait until every record is written; returns the token counts."""
        self._put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.counts

    def stop(self) -> None:
        import queue

        self.stopping = True
        while self.thread.is_alive():
            try:
                self.queue.get_nowait()
            except queue.Empty:
                pass
            try:
                self.queue.put_nowait(None)
            except queue.Full:
                pass
            self.thread.join(0.05)


def shard_done(directory: Path, plan: Plan, s: int) -> bool:
    idx, bin_path = directory / f"shard_{s:05d}.idx.npy", directory / fmt.shard_name(s)
    return idx.is_file() and bin_path.is_file() and bin_path.stat().st_size == plan.shard_bytes(s)


def write_shards(directory: Path, plan: Plan, rank: int, world: int, cfg, *, device: str | None = None, model=None,
                 session: "CaptureSession | None" = None) -> int:
    """Capture every unfinished shard s with s % world == rank; returns how many were written.

    `model`: an already loaded target (HF causal LM); otherwise the target of `cfg` is loaded.
    `session`: keeps a vLLM capture engine alive for the next split (`build_caches`)."""
    todo = [s for s in range(len(plan.shards)) if s % world == rank and not shard_done(directory, plan, s)]
    skipped = sum(1 for s in range(len(plan.shards)) if s % world == rank) - len(todo)
    if skipped:
        log.info("rank %d: %d shard(s) already complete, %d to write", rank, skipped, len(todo))
    if not todo:
        return 0
    featurize, close = make_featurizer(plan, cfg, device, model, session)
    tokenizer, _ = load_plan_inputs(cfg)
    total_tokens = sum(x.length for s in todo for x in plan.samples[plan.shards[s][0] : plan.shards[s][1]])
    bar = progress(total=total_tokens, desc=f"cache {plan.signature['split']}", unit="tok", unit_scale=True)
    bar.bytes_written = 0

    def saved() -> str:
        done = sum(shard_done(directory, plan, s) for s in range(len(plan.shards)))
        return f"{done} of {len(plan.shards)} shards of {directory} are complete (the shard being written was discarded)"

    try:
        with stop_on_signals(f"cache {plan.signature['split']}", saved):
            for s in todo:
                _write_shard(directory, plan, s, featurize, bar, tokenizer)
    finally:
        bar.close()
        close()
    return len(todo)


class CaptureSession:
    """One vLLM capture engine shared by the splits of a build (same config, same taps): its start-up (~15-25 s for
    SmolLM2 on CPU, more for a large target) is paid once, not once per split. Closed by `build_caches`."""

    def __init__(self) -> None:
        self._engine = None
        self.audit_model = None  # the target as transformers loads it, for the capture audit of each split (audit.py)

    def engine(self, make):
        if self._engine is None:
            self._engine = make()
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._engine = None


def make_featurizer(plan: Plan, cfg, device: str | None, model, session: CaptureSession | None = None):
    """(batch -> iterator of (sample, features)), and how to release it, for the plan's capture backend."""
    taps = plan.signature["taps"]
    reduction = plan.signature.get("tap_reduction", "mean")
    if plan.signature.get("capture_backend", "hf") == "vllm" and model is None:
        if plan.signature.get("hc_mult", 1) > 1 and reduction == "concat":
            raise CacheError(
                "cache.capture_backend=vllm returns one H-wide hidden state per layer, so it cannot store "
                "model.tap_reduction=concat for a multi-stream target; use cache.capture_backend=hf (target.device_map=auto "
                "spreads a large target over the GPUs) or model.tap_reduction=mean."
            )
        from deepspec.data.cache.vllm_capture import VLLMFeaturizer
        from deepspec.targets import resolve_target_path

        def make():
            return VLLMFeaturizer(
                resolve_target_path(cfg.target.name), taps, dtype=cfg.target.dtype, max_model_len=cfg.cache.max_length + 8,
                batch_tokens=plan.signature["batch_tokens"], revision=cfg.target.revision,
                trust_remote_code=cfg.target.trust_remote_code, vllm_kwargs=cfg.cache.vllm_kwargs,
            )

        if session is not None:
            return session.engine(make), (lambda: None)
        vf = make()
        return vf, vf.close
    if model is None:
        from deepspec.targets import load_target_from_config

        device = device or os.environ.get("DEEPSPEC_CACHE_DEVICE")
        if device is None:
            import torch

            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
        model = load_target_from_config(cfg.target, device=device).model
    return (lambda batch: stored_features(model, batch, taps, reduction, plan.dtype)), (lambda: None)


def target_identity(target_config, plan: Plan) -> dict[str, Any]:
    """What a cache manifest records of the target beside the plan's signature."""
    return {"target_architecture": (getattr(target_config, "architectures", None) or ["?"])[0],
            "target_num_layers": target_config.num_hidden_layers, "vocab_size": plan.vocab_size}


def finalize(directory: Path, plan: Plan, provenance: dict[str, Any]) -> dict[str, Any]:
    """Merge per-shard indices and counts, then write the manifest (atomically, last)."""
    rows, counts = [], np.zeros(max(plan.vocab_size, 1), dtype=np.int64)
    for s in range(len(plan.shards)):
        if not shard_done(directory, plan, s):
            raise CacheError(f"Shard {s} of {directory} is missing after all workers finished; rerun the same command to resume.")
        rows.append(np.load(directory / f"shard_{s:05d}.idx.npy"))
        c = np.load(directory / f"shard_{s:05d}.counts.npy")
        if len(c) > len(counts):
            counts = np.pad(counts, (0, len(c) - len(counts)))
        counts[: len(c)] += c
    index = np.concatenate(rows)
    fmt.write_npy_atomic(directory / fmt.INDEX, index)
    fmt.write_npy_atomic(directory / fmt.TOKEN_COUNTS, counts)
    fmt.write_json_atomic(directory / fmt.IDS, [s.id for s in plan.samples])
    sig = plan.signature
    manifest = {
        **provenance,
        **sig,
        "deepspec_version": __version__,
        "layout": "features[T, n_taps * rows + 1, H]: taps in `taps` order (each reduced by tap_reduction to rows * H, "
                  "rows = hc_mult for concat else 1, stored as its rows slices of H), then the final normed hidden state",
        "num_shards": len(plan.shards),
        "counts": plan.counts,
        "bytes": int(index["nbytes"].sum()),
        "data_path": plan.meta.get("data_path"),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    fmt.write_json_atomic(directory / fmt.MANIFEST, manifest)
    return manifest


# ---------------------------------------------------------------------------------- driver


def check_resumable_plan(directory: Path, plan: Plan) -> None:
    """A half-built cache may only be resumed with the same settings and data."""
    path = directory / fmt.PLAN
    if not path.is_file():
        fmt.write_json_atomic(path, plan.signature)
        return
    old = json.loads(path.read_text())
    diffs = [k for k in sorted(set(old) | set(plan.signature)) if old.get(k) != plan.signature.get(k)]
    if diffs:
        raise CacheError(
            f"{directory} holds a cache started with different settings ({', '.join(diffs)} differ); "
            "rerun with --overwrite to rebuild it, or set cache.dir elsewhere."
        )


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned_worker(rank: int, world: int, port: int, cfg, split: str, threads: int) -> None:
    """One CPU worker: joins a gloo group exactly as a torchrun rank would, then runs the same path."""
    import torch

    from deepspec.log import setup_logging

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["DEEPSPEC_CACHE_DEVICE"] = "cpu"
    setup_logging()
    torch.set_num_threads(threads)
    try:
        build_cache(cfg, split)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn_workers(mp, nproc: int, args: tuple) -> None:
    """mp.spawn, passing SIGTERM / SIGUSR1 on to the workers (each discards its partial shard) before exiting."""
    ctx = mp.spawn(_spawned_worker, args=args, nprocs=nproc, join=False)
    try:
        with stop_on_signals("cache", lambda: "complete shards are kept"):
            while not ctx.join():
                pass
    except mp.ProcessExitedException as e:  # killed (the OOM killer, a kill -9) or died without a Python error
        how = f"was killed by {e.signal_name}" if e.signal_name else f"exited with status {e.exit_code}"
        raise CacheError(f"Cache worker {e.error_index} (pid {e.error_pid}) {how}"
                         + (" (SIGKILL is often the out-of-memory killer: see `dmesg`)" if e.signal_name == "SIGKILL" else "")
                         + "; the other workers were stopped and every complete shard is kept: rerun the same command to "
                           "continue.") from None
    except Preempted as e:
        for proc in ctx.processes:
            if proc.is_alive():
                os.kill(proc.pid, e.signum)
        for proc in ctx.processes:
            proc.join(60)
        raise


def load_plan_inputs(cfg):
    from transformers import AutoConfig

    from deepspec.targets import load_tokenizer, resolve_target_path

    tokenizer = load_tokenizer(cfg.target.name, cfg.target.revision, cfg.target.trust_remote_code)
    tconf = AutoConfig.from_pretrained(
        resolve_target_path(cfg.target.name), revision=cfg.target.revision, trust_remote_code=cfg.target.trust_remote_code
    )
    tconf = getattr(tconf, "text_config", None) or tconf
    return tokenizer, tconf


def plan_split(cfg, split: str) -> Plan:
    tokenizer, tconf = load_plan_inputs(cfg)
    return make_plan(cfg, split, tokenizer, tconf)


def build_caches(cfg, splits: list[str], *, overwrite: bool = False, nproc: int | None = None) -> list[Path]:
    """Build (or resume) several splits (train, heldout) with one capture engine; returns their directories."""
    session = CaptureSession()
    try:
        return [build_cache(cfg, split, overwrite=overwrite, nproc=nproc, session=session) for split in splits]
    finally:
        session.close()


def build_cache(cfg, split: str = "train", *, overwrite: bool = False, nproc: int | None = None,
                session: CaptureSession | None = None) -> Path:
    """Build (or resume) the cache of one split; returns its directory. Skips a complete matching cache.

    Workers: under torchrun (WORLD_SIZE > 1) each rank takes its shards and rank 0 finalizes;
    otherwise `nproc` (default cache.num_workers) CPU processes are spawned. `session`: see `build_caches`.
    One build per folder: rank 0 (or the single process) holds the split folder's lock (deepspec/locks.py)."""
    from deepspec.locks import folder_lock

    _, directory = split_paths(cfg, split)
    with folder_lock(directory, "cache build", enabled=int(os.environ.get("RANK", "0")) == 0):
        return _build_cache(cfg, split, overwrite=overwrite, nproc=nproc, session=session)


def _build_cache(cfg, split: str, *, overwrite: bool, nproc: int | None, session: CaptureSession | None) -> Path:
    from deepspec.config import save_config

    _, directory = split_paths(cfg, split)
    directory = Path(directory)
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    rank_env = int(os.environ.get("RANK", "0"))
    check_workers(cfg, world_env if world_env > 1 else (nproc or cfg.cache.num_workers or 1))
    if overwrite and directory.exists() and rank_env == 0:
        shutil.rmtree(directory)
    if world_env > 1:
        _barrier()
    tokenizer, tconf = load_plan_inputs(cfg)
    plan = make_plan(cfg, split, tokenizer, tconf)
    if fmt.is_complete(directory):
        manifest = fmt.load_manifest(directory)
        diffs = [k for k, v in plan.signature.items() if manifest.get(k) != v]
        if not diffs:
            log.info("cache %s is complete; skipping (use --overwrite to rebuild)", directory)
            return directory
        raise CacheError(
            f"{directory} holds a complete cache built with different settings ({', '.join(diffs)} differ); "
            "rerun with --overwrite to rebuild it."
        )
    est = estimate(plan)
    log.info(
        "cache %s: %d samples, %d tokens (%d dropped < %d loss tokens, %d truncated) -> %.3f GiB in %d shard(s)",
        split, est["samples"], est["tokens"], est["dropped_short"], cfg.cache.min_loss_tokens, est["truncated"], est["gib"], est["shards"],
    )
    _size_check(directory, plan, cfg, world_env, rank_env)  # before any file is written or any target is loaded
    directory.mkdir(parents=True, exist_ok=True)
    if rank_env == 0:
        check_resumable_plan(directory, plan)
    if world_env > 1:
        _barrier()
        check_resumable_plan(directory, plan)
        write_shards(directory, plan, rank_env, world_env, cfg=cfg)
        _barrier()
    else:
        nproc = nproc or cfg.cache.num_workers or 1
        if nproc <= 1:
            write_shards(directory, plan, 0, 1, cfg=cfg, session=session)
        else:
            import torch.multiprocessing as mp

            threads = threads_per_worker(nproc)
            try:
                _spawn_workers(mp, nproc, (nproc, _free_port(), cfg, split, threads))
            except mp.ProcessRaisedException as e:
                last = str(e).strip().splitlines()[-1]
                raise CacheError(f"A cache worker failed ({last}); fix the cause and rerun the same command to resume.") from None
            except mp.ProcessExitedException as e:
                raise CacheError(f"A cache worker died ({e}); rerun the same command to resume.") from None
            return directory  # rank 0 of the workers finalized it
    if rank_env == 0:
        save_config(cfg, directory)
        finalize(directory, plan, target_identity(tconf, plan))  # the manifest goes last
        log.info("cache %s complete: %s", split, directory)
        from deepspec.data.cache.audit import audit_after_build

        audit_after_build(cfg, directory, session)  # audit.json beside the manifest; a failed capture stops here
    if world_env > 1:
        _barrier()
    return directory


def _size_check(directory: Path, plan: Plan, cfg, world: int, rank: int) -> None:
    """guards.check_size, decided once: under torchrun rank 0 checks and every rank raises the same error (a rank
    that passed while another stopped would wait at the next barrier for hours)."""
    if world <= 1:
        check_size(directory, plan, cfg)
        return
    import torch.distributed as dist

    message = [None]
    if rank == 0:
        try:
            check_size(directory, plan, cfg)
        except CacheError as e:
            message = [str(e)]
    _barrier()  # joins the group
    dist.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise CacheError(message[0])


def _barrier() -> None:
    """Barriers between cache workers. The group only ever synchronises (no tensors), so it is gloo on any machine:
    NCCL would tie each rank to a GPU, and `--nproc N` CPU workers on a GPU machine all map to the same one."""
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        # ranks that finish their shards wait at the last barrier for the slowest one: hours at scale, not
        # the default 30 minutes
        hours = float(os.environ.get("DEEPSPEC_CACHE_BARRIER_HOURS", "72"))
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=hours))
    dist.barrier()
