"""JSONL helpers that survive crashes.

Why: a stage killed mid-write must never leave a torn record or lose finished ones. Writers
append whole lines and fsync; readers (and resuming writers) drop an unterminated last line;
whole-file outputs are written to a temp file and renamed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from deepspec.errors import DataError


class MalformedLineError(DataError, ValueError):
    """A line of a JSONL file that is not JSON (a ValueError as well, for callers that caught that before)."""


def dumps(record: Any) -> str:
    """One JSON line (no newline) with non-ASCII kept readable."""
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"))


def iter_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of every *complete* non-blank line; a torn last line is ignored."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                return  # torn tail from a killed writer
            text = raw.decode("utf-8", errors="replace").strip()
            if text:
                yield lineno, text


def parse_line(path: str | Path, lineno: int, text: str) -> Any:
    """One JSON line; a malformed one is a DataError naming the file and line (a ValueError too)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise MalformedLineError(
            f"{path}:{lineno} is not valid JSON ({e.msg} at column {e.colno}); fix or delete that line, or rebuild the "
            "file with --overwrite."
        ) from None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every complete record of a JSONL file written by us (a bad line raises MalformedLineError naming it)."""
    return [parse_line(path, lineno, text) for lineno, text in iter_lines(path)]


def repair_tail(path: str | Path) -> int:
    """Truncate a torn (unterminated or unparsable) last line in place; returns bytes removed."""
    path = Path(path)
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        # Find the start of the last line (scan backwards in blocks).
        end = size
        f.seek(size - 1)
        terminated = f.read(1) == b"\n"
        search_end = size - 1 if terminated else size
        pos, start = search_end, 0
        while pos > 0:
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            block = f.read(step)
            idx = block.rfind(b"\n")
            if idx >= 0:
                start = pos + idx + 1
                break
        f.seek(start)
        last = f.read(end - start)
        keep = end
        if not terminated:
            keep = start
        elif last.strip():
            try:
                json.loads(last)
            except ValueError:
                keep = start
        if keep < size:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
        return size - keep


class JsonlAppender:
    """Append whole records durably: each `write` is one line, flushed and fsynced before returning."""

    def __init__(self, path: str | Path, fsync: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_tail(self.path)
        self._fh = open(self.path, "ab", buffering=0)  # unbuffered: a failed write leaves no bytes queued to flush later
        self._fsync = fsync

    def write(self, record: Any) -> None:
        self.write_many([record])

    def write_many(self, records: Iterable[Any]) -> None:
        data = b"".join((dumps(r) + "\n").encode("utf-8") for r in records)
        if not data:
            return
        from deepspec.diskfull import room_for

        fd = self._fh.fileno()
        start = os.lseek(fd, 0, os.SEEK_END)
        # a full disk cuts the file back to its last whole row (a kill can still leave one torn tail line, which
        # readers skip and a resuming writer cuts)
        with room_for(self.path, len(data), "rows to", cleanup=lambda: os.ftruncate(fd, start)):
            view = memoryview(data)
            while view:
                n = self._fh.write(view)
                view = view[n or 0:]
            if self._fsync:
                os.fsync(fd)

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_jsonl_atomic(path: str | Path, records: Iterable[Any]) -> int:
    """Write all records to `path` via a temp file + rename, so readers see all or nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    n = 0
    with open(tmp, "wb") as f:
        for r in records:
            f.write((dumps(r) + "\n").encode("utf-8"))
            n += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return n
