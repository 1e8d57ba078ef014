"""One run per folder: a lock beside each folder a stage writes (run, cache split, data).

Why: two runs of one recipe (two people, or a requeued job next to a live one) would write the same `step_N`, logs
and cache shards. The lock is `<parent>/.<folder name>.lock` (beside the folder, so deleting or rebuilding the folder
never removes it), holding who took it: host, pid, start time, command. It is held with `flock` for the life of the
stage, so the kernel releases it when the holder dies, even by SIGKILL; a later run finds the file, gets the flock,
and takes the lock over with a warning naming the dead holder. A holder that is alive stops the second run at once
with one sentence naming it. Children of a holder (spawned workers) inherit it through DEEPSPEC_HELD_LOCKS.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

from deepspec.errors import DeepSpecError
from deepspec.log import get_logger

log = get_logger(__name__)

HELD_ENV = "DEEPSPEC_HELD_LOCKS"


class FolderInUseError(DeepSpecError):
    """Another live process holds the folder's lock."""


def lock_path(folder: str | Path) -> Path:
    folder = Path(folder).absolute()
    return folder.parent / f".{folder.name}.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (started {when}: {holder.get('command', '?')})"


class FolderLock:
    """An exclusive lock on `folder` for one stage (`what`: run, cache, regenerate ...)."""

    def __init__(self, folder: str | Path, what: str):
        self.folder, self.what = Path(folder).absolute(), what
        self.path = lock_path(folder)
        self._fd: int | None = None

    def acquire(self) -> None:
        if str(self.path) in os.environ.get(HELD_ENV, "").split(os.pathsep):
            return  # our parent holds it (spawned worker processes)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise FolderInUseError(self._in_use_message(self._read_holder())) from None
            # the file may have been unlinked by its previous holder between our open and flock: retry on the new one
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            holder = self._read_fd(fd)
            if holder and holder.get("host") == socket.gethostname() and holder.get("pid") != os.getpid() \
                    and _pid_alive(int(holder.get("pid", -1))) and holder.get("pid_start") == _pid_start(int(holder["pid"])):
                os.close(fd)  # a filesystem whose flock always succeeds: trust the pid check instead
                raise FolderInUseError(self._in_use_message(holder))
            if holder:
                log.warning("%s: taking over the lock of %s, which is no longer running (%s)", self.folder, _describe(holder), self.path)
            self._write_fd(fd)
            self._fd = fd
            held = [p for p in os.environ.get(HELD_ENV, "").split(os.pathsep) if p]
            os.environ[HELD_ENV] = os.pathsep.join([*held, str(self.path)])
            return
        raise FolderInUseError(f"Could not lock {self.folder} ({self.path} keeps changing); another run is starting there.")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if self._read_fd(self._fd).get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)  # unlinked while still flocked: a waiting opener retries (inode check)
        finally:
            os.close(self._fd)
            self._fd = None
            held = [p for p in os.environ.get(HELD_ENV, "").split(os.pathsep) if p and p != str(self.path)]
            if held:
                os.environ[HELD_ENV] = os.pathsep.join(held)
            else:
                os.environ.pop(HELD_ENV, None)

    def _in_use_message(self, holder: dict) -> str:
        return (f"{self.folder} is in use by another {holder.get('what') or self.what}: {_describe(holder)}; wait for it to finish or stop it, "
                f"or use another folder (lock file {self.path}).")

    def _read_holder(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    @staticmethod
    def _read_fd(fd: int) -> dict:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            data = os.read(fd, 65536)
            return json.loads(data or b"{}")
        except (OSError, ValueError):
            return {}

    def _write_fd(self, fd: int) -> None:
        info = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _pid_start(os.getpid()), "started": time.time(),
                "what": self.what, "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(info) + "\n").encode())
        os.fsync(fd)

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _pid_start(pid: int) -> int | None:
    """The process's start time in clock ticks (Linux), so a reused pid is not mistaken for the holder."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


@contextlib.contextmanager
def folder_lock(folder: str | Path, what: str, enabled: bool = True) -> Iterator[FolderLock | None]:
    """Hold the lock of `folder` for the block (no-op when not `enabled`, e.g. on ranks other than 0)."""
    if not enabled:
        yield None
        return
    lock = FolderLock(folder, what)
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()
