"""Where prompts come from: the embedded offline set, local JSONL / JSON / parquet files, or a
Hugging Face dataset id. Every source yields raw records tagged with their origin (file:line),
so validation errors point at the exact place to fix.

Record shapes accepted (one conversation per record):
  - OpenAI style: ``{"messages" | "conversations" | "conversation": [{"role", "content"}, ...]}``
  - ShareGPT style: the same keys with ``[{"from", "value"}, ...]`` (human->user, gpt->assistant, ...)
  - a bare prompt: ``{"prompt": "..."}`` (or ``prompt`` holding a message list), ``{"instruction", "input"}``
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepspec.errors import DataError, MissingDependencyError

ROLE_MAP = {
    "user": "user", "human": "user", "prompter": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "model": "assistant", "bot": "assistant",
    "system": "system",
}
_MESSAGE_KEYS = ("conversations", "messages", "conversation")


@dataclass
class RawRecord:
    origin: str  # "path:line" or "dataset[split]#index"
    record: Any  # parsed JSON value, or None when `error` is set
    error: str | None = None


class InvalidRecord(ValueError):
    """A record that cannot be turned into a conversation; the message says why."""


def normalize(record: Any) -> tuple[str | None, list[dict[str, str]], dict[str, Any]]:
    """(id or None, conversation, meta) of a raw record, or raise InvalidRecord.

    A valid conversation is an optional system message, then user/assistant turns alternating
    and starting with user; every content is a non-empty string.
    """
    if not isinstance(record, dict):
        raise InvalidRecord(f"expected a JSON object, got {type(record).__name__}")
    messages = None
    for key in _MESSAGE_KEYS:
        if key in record:
            messages = record[key]
            break
    if messages is None and "prompt" in record:
        messages = record["prompt"] if isinstance(record["prompt"], list) else [{"role": "user", "content": record["prompt"]}]
    if messages is None and "instruction" in record:
        text = record["instruction"]
        if isinstance(text, str) and isinstance(record.get("input"), str) and record["input"].strip():
            text = f"{text}\n\n{record['input']}"
        messages = [{"role": "user", "content": text}]
    if messages is None:
        raise InvalidRecord(f"no conversation found (expected one of {', '.join(_MESSAGE_KEYS)} or 'prompt')")
    if not isinstance(messages, list) or not messages:
        raise InvalidRecord("the conversation is empty or not a list")
    conv: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRecord(f"message {i} is not an object")
        raw_role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        role = ROLE_MAP.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise InvalidRecord(f"message {i} has unknown role {raw_role!r}")
        if not isinstance(content, str):
            raise InvalidRecord(f"message {i} content is {type(content).__name__}, not a string")
        if not content.strip():
            raise InvalidRecord(f"message {i} ({role}) has empty content")
        conv.append({"role": role, "content": content})
    body = conv[1:] if conv[0]["role"] == "system" else conv
    if not body:
        raise InvalidRecord("the conversation has no user turn")
    for i, m in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            offset = len(conv) - len(body)
            raise InvalidRecord(f"roles out of order: message {i + offset} is {m['role']!r}, expected {expected!r}")
    rid = record.get("id")
    meta = record.get("meta") if isinstance(record.get("meta"), dict) else {}
    return (None if rid is None else str(rid)), conv, dict(meta)


def _iter_json_lines(path: Path, opener) -> Iterator[RawRecord]:
    with opener(path) as f:
        for lineno, raw in enumerate(f, start=1):
            text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
            if not text.strip():
                continue
            try:
                yield RawRecord(f"{path}:{lineno}", json.loads(text))
            except json.JSONDecodeError as e:
                yield RawRecord(f"{path}:{lineno}", None, f"invalid JSON ({e.msg} at column {e.colno})")


def iter_file(path: str | Path) -> Iterator[RawRecord]:
    """Records of a local .jsonl(.gz) / .json / .parquet file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"Prompt file {path} does not exist; fix data.prompts.files.")
    name = path.name.lower()
    if name.endswith((".jsonl", ".ndjson")):
        yield from _iter_json_lines(path, lambda p: open(p, "rb"))
    elif name.endswith((".jsonl.gz", ".ndjson.gz")):
        yield from _iter_json_lines(path, lambda p: gzip.open(p, "rb"))
    elif name.endswith(".json"):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg}); fix the file or convert it to JSONL.") from None
        if isinstance(data, dict):
            data = next((data[k] for k in ("data", "records", "conversations") if isinstance(data.get(k), list)), [data])
        for i, rec in enumerate(data):
            yield RawRecord(f"{path}#{i}", rec)
    elif name.endswith(".parquet"):
        import pyarrow.parquet as pq

        for i, rec in enumerate(pq.read_table(path).to_pylist()):
            yield RawRecord(f"{path}#{i}", rec)
    else:
        raise DataError(f"Prompt file {path} has an unknown extension; use .jsonl, .jsonl.gz, .json or .parquet.")


def iter_embedded() -> Iterator[RawRecord]:
    """The offline prompt set committed in deepspec/data/embedded (see build.py for provenance)."""
    from deepspec.data.embedded import PROMPTS_FILE

    yield from _iter_json_lines(PROMPTS_FILE, lambda p: gzip.open(p, "rb"))


def iter_hf_dataset(name: str, split: str) -> Iterator[RawRecord]:
    """Records of a Hugging Face dataset (needs network or a local HF cache)."""
    try:
        import datasets
    except ImportError:
        raise MissingDependencyError("datasets", "Loading prompts from a Hugging Face dataset") from None
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises many types; all mean "cannot load"
        raise DataError(
            f"Could not load Hugging Face dataset '{name}' split '{split}' ({type(e).__name__}: {e}); "
            "check data.prompts.source/split and network access, or use local files."
        ) from None
    for i, rec in enumerate(ds):
        yield RawRecord(f"{name}[{split}]#{i}", rec)


def is_local_spec(source: str) -> bool:
    return source in ("files", "local") or Path(source).expanduser().exists()


def iter_source(source: str, files: list[str], split: str) -> Iterator[RawRecord]:
    """Dispatch on `data.prompts.source`: 'embedded', 'files' (+ data.prompts.files), a path, or an HF id."""
    if source == "embedded":
        yield from iter_embedded()
    elif source in ("files", "local"):
        if not files:
            raise DataError("data.prompts.source is 'files' but data.prompts.files is empty; list JSONL/JSON/parquet paths.")
        for f in files:
            yield from iter_file(f)
    elif Path(source).expanduser().exists():
        p = Path(source).expanduser()
        paths = sorted(q for q in p.rglob("*") if q.is_file() and q.name.lower().endswith(
            (".jsonl", ".jsonl.gz", ".ndjson", ".json", ".parquet"))) if p.is_dir() else [p]
        for f in paths:
            yield from iter_file(f)
    else:
        if files:
            raise DataError(f"data.prompts.files is set but source is '{source}'; set source: files to use local files.")
        yield from iter_hf_dataset(source, split)


def source_provenance(source: str, files: list[str], split: str) -> dict[str, Any]:
    """What the prompts were made from, recorded in the summary next to the artifact."""
    if source == "embedded":
        from deepspec.data.embedded import provenance

        return {"kind": "embedded", **provenance()}
    if is_local_spec(source):
        paths = files if source in ("files", "local") else [source]
        return {"kind": "files", "files": [str(Path(p).expanduser().resolve()) for p in paths]}
    return {"kind": "hf_dataset", "dataset": source, "split": split}
