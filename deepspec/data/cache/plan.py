"""The plan of a cache build: read the conversations, tokenize them and cut shards, before any target forward.

Why a plan first: tokenizing is cheap next to the target forward, and knowing every sample's
length up front fixes the shard boundaries as a pure function of (data, settings). So
  * `--estimate` is exact and writes nothing;
  * N workers can take shards i ≡ rank (mod N) and still produce the very cache a single
    worker does (same shards, same batches inside each shard);
  * a resumed build is checked against the plan it started with (`check_resumable_plan`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from deepspec.data.cache import format as fmt
from deepspec.data.cache.sample import Sample
from deepspec.data.chat import render_conversation
from deepspec.errors import CacheError, DataError
from deepspec.hashing import file_sha256
from deepspec.log import progress
from deepspec.targets.load import resolve_dtype_name


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


def load_plan_inputs(cfg):
    """(tokenizer, the target's HF config, its text config for a multimodal one): all a plan needs of the target, no weights."""
    from deepspec.targets import load_tokenizer

    return load_tokenizer(cfg.target.name, cfg.target.revision, cfg.target.trust_remote_code), load_target_config(cfg)


def load_target_config(cfg):
    """The target's HF config (its text config for a multimodal one), without its tokenizer or weights: its recorded
    numbers where this machine resolved it before (deepspec/targets/hf_config.py)."""
    from deepspec.targets.hf_config import target_config

    return target_config(cfg.target.name, cfg.target.revision, cfg.target.trust_remote_code)


def plan_split(cfg, split: str) -> Plan:
    tokenizer, tconf = load_plan_inputs(cfg)
    return make_plan(cfg, split, tokenizer, tconf)
