"""Full disks: a write that runs out of space (ENOSPC), quota (EDQUOT) or file-size limit (EFBIG) becomes one
sentence naming the path and the bytes it needs, instead of a traceback from deep inside torch or safetensors.

Every writer that uses this writes to a temporary name and renames it when complete (or, for appended JSONL rows,
cuts the file back to its last whole row), so nothing partial is ever read as valid, the previous checkpoint stays
intact, and the same command continues once space is freed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
from pathlib import Path
from typing import Callable, Iterator

from deepspec.errors import DeepSpecError

_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
# how torch's and safetensors' writers word the same failures (they do not raise OSError)
_MARKERS = ("No space left", "File too large", "Disk quota", "FileTooLarge", "StorageFull", "os error 28", "os error 27",
            "code: 28", "code: 27")


class DiskFullError(DeepSpecError):
    """A write failed for lack of space (disk, quota or file-size limit)."""


def _fsize_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def is_disk_full(exc: BaseException, needed: int | None = None, path: Path | None = None) -> bool:
    """Whether `exc` means "no room": the errno, the writers' wording, or torch's bare "file write failed" when a
    file-size limit is set or the free space is below what the write needs."""
    if isinstance(exc, OSError) and exc.errno in _ERRNOS:
        return True
    text = str(exc)
    if any(m in text for m in _MARKERS):
        return True
    if "write failed" in text or "failed writing" in text:
        return _fsize_limit() is not None or (needed is not None and path is not None and _free(path) < needed)
    return False


def _free(path: Path) -> int:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return -1


def sentence(path: Path, needed: int | None, what: str, after: str) -> str:
    limit = _fsize_limit()
    room = f"{_free(path):,} bytes are free there" + (f" and files may not exceed {limit:,} bytes (ulimit -f)" if limit else "")
    need = f"about {needed:,} bytes" if needed else "more space"
    return f"No room to write {what} {path}: it needs {need}, {room}. {after}"


@contextlib.contextmanager
def room_for(path: str | Path, needed: int | Callable[[], int] | None, what: str,
             after: str = "Free some space and rerun the same command to continue.",
             cleanup: Callable[[], None] | None = None) -> Iterator[None]:
    """Turn a disk-full failure inside the block into DiskFullError (after `cleanup`, e.g. removing a temporary)."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:  # noqa: BLE001 - only disk-full failures are translated; the rest are re-raised
        n = needed() if callable(needed) else needed
        if not is_disk_full(e, n, Path(path)):
            raise
        if cleanup is not None:
            with contextlib.suppress(Exception):
                cleanup()
        raise DiskFullError(sentence(Path(path), n, what, after)) from None


def tensor_bytes(obj) -> int:
    """Bytes of every tensor inside nested dicts / lists (what a torch.save of `obj` needs, roughly)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def file_size(path: str | Path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
