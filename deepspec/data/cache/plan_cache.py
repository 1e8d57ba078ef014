"""Tokenized plans kept on disk: one process renders and tokenizes a split, every other one loads the result.

Planning renders every conversation through the chat template and tokenizes it (minutes for a million
conversations), and it happens in every process that needs the plan: each trainer rank and each producer of a
streamed run, each rank of a torchrun cache build, and all of them again after every restart. The result depends
only on the data file's bytes, the tokenizer, the chat template and the rendering settings, so it is stored once
under a name hashed from exactly those (`<data folder>/.plans/<split>-<hash>.npz`): a changed input is a new file,
never a stale plan. The first process takes a lock and writes it (atomically); the others wait on the lock and load it.
A folder that cannot be written (a read-only dataset) only means each process tokenizes for itself, as before.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from deepspec.log import get_logger

log = get_logger(__name__)

VERSION = 1  # bump when rendering or the stored fields change meaning

Tokenized = tuple[list, dict[str, int], "np.ndarray | None"]  # (samples, counts, loss-token counts or None)


def tokenizer_fingerprint(tokenizer) -> str:
    """What the token ids depend on besides the template: the vocabulary and the special tokens."""
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def plan_key(fields: dict[str, Any]) -> str:
    from deepspec import __version__

    blob = json.dumps({"v": VERSION, "deepspec": __version__, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _save(path: Path, samples: list, counts: dict[str, int], token_counts: np.ndarray | None) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    arrays = {
        "ids": np.frombuffer(json.dumps([s.id for s in samples]).encode(), dtype=np.uint8),
        "length": np.asarray([s.length for s in samples], dtype=np.int64),
        "offset": np.asarray([s.offset for s in samples], dtype=np.int64),
        "truncated": np.asarray([s.truncated for s in samples], dtype=bool),
        "counts": np.frombuffer(json.dumps(counts).encode(), dtype=np.uint8),
    }
    if token_counts is not None:
        arrays["token_counts"] = token_counts
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _load(path: Path) -> Tokenized:
    from deepspec.data.cache.sample import Sample

    with np.load(path, allow_pickle=False) as z:
        ids = json.loads(z["ids"].tobytes())
        samples = [Sample(sid, None, None, bool(t), length=int(n), offset=int(o))
                   for sid, n, o, t in zip(ids, z["length"].tolist(), z["offset"].tolist(), z["truncated"].tolist())]
        counts = json.loads(z["counts"].tobytes())
        token_counts = z["token_counts"].copy() if "token_counts" in z.files else None
    return samples, counts, token_counts


def tokenized(src: Path, split: str, fields: dict[str, Any], build: Callable[[], Tokenized]) -> Tokenized:
    """`build()`'s result for these inputs: loaded when a process already stored it, else built and stored."""
    folder = Path(src).parent / ".plans"
    path = folder / f"{split}-{plan_key(fields)}.npz"
    try:
        folder.mkdir(exist_ok=True)
        lock = open(folder / f".{path.stem}.lock", "a+")
    except OSError as e:
        log.debug("plan not shared (%s): tokenizing in this process", e)
        return build()
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first process tokenizes; the others wait here, then load
        if path.is_file():
            try:
                out = _load(path)
                log.info("plan of %s: %d samples loaded from %s (tokenized once, by an earlier process)", split, len(out[0]), path)
                return out
            except (OSError, ValueError, KeyError) as e:  # a damaged file: tokenize again and replace it
                log.warning("plan file %s is unreadable (%s); tokenizing again", path, e)
        out = build()
        try:
            _save(path, *out)
            _prune(folder, keep=KEEP)
        except OSError as e:
            log.warning("could not store the plan at %s (%s); other processes tokenize for themselves", path, e)
        return out


KEEP = 8  # plans kept per data folder (recipes differing in max_length, template or data each have one)


def _prune(folder: Path, keep: int) -> None:
    """Remove all but the `keep` most recently written plans (an edited data file leaves its old plan behind)."""
    plans = sorted(folder.glob("*.npz"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in plans[keep:]:
        old.unlink(missing_ok=True)
        (folder / f".{old.stem}.lock").unlink(missing_ok=True)
