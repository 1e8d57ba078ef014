"""One run per folder: a lock beside each folder a stage writes (run, cache split, data).

Why: two runs of one recipe (two people, or a requeued job next to a live one) would write the same `step_N`, logs
and cache shards. The lock is `<parent>/.<folder name>.lock` (beside the folder, so deleting or rebuilding the folder
never removes it), holding who took it: host, pid, start time, command, and a heartbeat. It is held with `flock` for
the life of the stage, so the kernel releases it when the holder dies, even by SIGKILL; a later run finds the file,
gets the flock, and takes the lock over with a warning naming the dead holder. A holder that is alive stops the second
run at once with one sentence naming it. Children of a holder (spawned workers) inherit it through DEEPSPEC_HELD_LOCKS.

Shared filesystems: `flock` may be node-local (Lustre `localflock`, some GPFS / NFS mounts: another node's flock never
conflicts with ours) or missing (ENOSYS / EOPNOTSUPP / ENOLCK, Lustre `noflock`), and a pid means nothing on another
host. So the holder rewrites the file's `heartbeat` (its wall-clock time) from a daemon thread every
DEEPSPEC_LOCK_HEARTBEAT_S seconds (30) for as long as it holds the lock — a thread, not a hook in the stages, because a
multi-day run spends minutes at a time in a validation, a checkpoint write or a cache shard. A holder on another host
whose heartbeat is younger than DEEPSPEC_LOCK_STALE_S (300) is refused like a live local one; an older one is taken
over with a warning saying how old its heartbeat was. On the same host the pid decides, as with flock. Hosts' clocks
must agree to well within the staleness limit (NTP does).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

from deepspec.errors import ConfigError, DeepSpecError
from deepspec.log import get_logger

log = get_logger(__name__)

HELD_ENV = "DEEPSPEC_HELD_LOCKS"
HEARTBEAT_ENV = "DEEPSPEC_LOCK_HEARTBEAT_S"
STALE_ENV = "DEEPSPEC_LOCK_STALE_S"
DEFAULT_HEARTBEAT_S = 30.0
DEFAULT_STALE_S = 300.0
# flock errors that mean "this filesystem has no flock", not "someone holds it"
_NO_FLOCK = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK}
# without flock two starters may both find the lock free: each writes its claim, waits this long, and keeps the lock
# only if the file still names it (the later writer wins, the other is refused)
_SETTLE_S = 0.5
_PAD = 32  # spare bytes after the record, so a heartbeat rewrites the file in place at the same length
_warned_no_flock: set[int] = set()


class FolderInUseError(DeepSpecError):
    """Another live process holds the folder's lock."""


def lock_path(folder: str | Path) -> Path:
    folder = Path(folder).absolute()
    return folder.parent / f".{folder.name}.lock"


def lock_timing() -> tuple[float, float]:
    """(heartbeat interval, staleness limit) in seconds, from DEEPSPEC_LOCK_HEARTBEAT_S / DEEPSPEC_LOCK_STALE_S."""
    every, stale = _env_seconds(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S), _env_seconds(STALE_ENV, DEFAULT_STALE_S)
    if stale <= 2 * every:
        raise ConfigError(f"{STALE_ENV}={stale:g} must be more than twice {HEARTBEAT_ENV}={every:g}, or a live holder's lock "
                          f"could look abandoned; raise {STALE_ENV} or lower {HEARTBEAT_ENV}.")
    return every, stale


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{name}={raw!r} is not a positive number of seconds; set it to e.g. {default:g} or unset it.")
    return value


def pid_alive(pid: int) -> bool:
    """Whether a process of this id runs on this machine (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _heartbeat_age(holder: dict) -> float | None:
    """Seconds since the holder last wrote its heartbeat (its start for files without one), None when unknown."""
    beat = holder.get("heartbeat", holder.get("started"))
    return time.time() - beat if isinstance(beat, (int, float)) else None


def _describe(holder: dict, beat: bool = True) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    age = _heartbeat_age(holder) if beat and "heartbeat" in holder else None
    beat = f", heartbeat {max(age, 0.0):.0f} s ago" if age is not None else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (started {when}: {holder.get('command', '?')}{beat})"


def _warn_no_flock(path: Path, err: OSError, every: float, stale: float) -> None:
    """Once per filesystem and process: say that locks there rest on the heartbeat alone."""
    try:
        dev = os.stat(path.parent).st_dev
    except OSError:
        dev = -1
    if dev in _warned_no_flock:
        return
    _warned_no_flock.add(dev)
    log.warning("the filesystem of %s has no flock (%s); its folder locks rest on their heartbeat alone: a holder rewrites "
                "it every %g s (%s) and a lock whose heartbeat is older than %g s (%s) is taken over",
                path.parent, errno.errorcode.get(err.errno, err.errno), every, HEARTBEAT_ENV, stale, STALE_ENV)


class FolderLock:
    """An exclusive lock on `folder` for one stage (`what`: run, cache, regenerate ...)."""

    def __init__(self, folder: str | Path, what: str):
        self.folder, self.what = Path(folder).absolute(), what
        self.path = lock_path(folder)
        self._fd: int | None = None
        self._mutex = threading.Lock()  # the heartbeat thread never writes to a descriptor release() closed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._record: dict = {}
        self._size = 0

    def acquire(self) -> None:
        if str(self.path) in os.environ.get(HELD_ENV, "").split(os.pathsep):
            return  # our parent holds it (spawned worker processes)
        every, stale = lock_timing()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                flocked = self._flock(fd, every, stale)
                # the file may have been unlinked by its previous holder between our open and flock: retry on the new one
                try:
                    same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
                self._claim(fd, self._read_fd(fd), stale)
                if not flocked:
                    time.sleep(_SETTLE_S)
                    now = self._read_fd(fd)
                    if not self._is_ours(now):
                        raise FolderInUseError(self._in_use_message(now))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            self._fd = fd
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat_every, args=(every,), name="deepspec-lock-heartbeat", daemon=True)
            self._thread.start()
            held = [p for p in os.environ.get(HELD_ENV, "").split(os.pathsep) if p]
            os.environ[HELD_ENV] = os.pathsep.join([*held, str(self.path)])
            return
        raise FolderInUseError(f"Could not lock {self.folder} ({self.path} keeps changing); another run is starting there.")

    def _flock(self, fd: int, every: float, stale: float) -> bool:
        """True when flocked; False where the filesystem has no flock (the heartbeat alone decides); raises when held."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FolderInUseError(self._in_use_message(self._read_holder())) from None
            if e.errno in _NO_FLOCK:
                _warn_no_flock(self.path, e, every, stale)
                return False
            raise
        return True

    def _claim(self, fd: int, holder: dict, stale: float) -> None:
        """Write our record into the lock file unless `holder` (what it holds now) is alive; warn when taking it over."""
        if holder and holder.get("host") != socket.gethostname():
            age = _heartbeat_age(holder)
            if age is not None and age < stale:  # a live holder on another node (its flock, if any, is not ours to see)
                raise FolderInUseError(self._in_use_message(holder))
            log.warning("%s: taking over the lock of %s, whose heartbeat is %s old (stale after %s=%g s) (%s)", self.folder,
                        _describe(holder, beat=False), f"{age:.1f} s" if age is not None else "of unknown age", STALE_ENV,
                        stale, self.path)
        elif holder:
            if holder.get("pid") != os.getpid() and pid_alive(int(holder.get("pid", -1))) \
                    and holder.get("pid_start") == _pid_start(int(holder["pid"])):
                raise FolderInUseError(self._in_use_message(holder))  # flock succeeded anyway: trust the pid check
            log.warning("%s: taking over the lock of %s, which is no longer running (%s)", self.folder, _describe(holder), self.path)
        self._record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _pid_start(os.getpid()),
                        "started": time.time(), "what": self.what, "command": " ".join(sys.argv)[:300],
                        "token": uuid.uuid4().hex}
        self._size = 0
        self._write_fd(fd)

    def _is_ours(self, holder: dict) -> bool:
        return bool(self._record) and holder.get("token") == self._record["token"] and holder.get("pid") == os.getpid()

    def _beat_every(self, every: float) -> None:
        failing = False
        while not self._stop.wait(every):
            try:
                if not self._beat():
                    return
                failing = False
            except OSError as e:  # a filesystem hiccup: say so once, keep trying
                if not failing:
                    log.warning("%s: could not refresh the heartbeat of %s (%s); retrying every %g s", self.folder, self.path, e, every)
                failing = True

    def _beat(self) -> bool:
        """Refresh the heartbeat; False (and a warning) when the lock is no longer ours to refresh."""
        with self._mutex:
            if self._fd is None or self._stop.is_set():
                return False
            holder = self._read_fd(self._fd)
            if holder and not self._is_ours(holder):
                log.warning("%s: %s was taken over by %s after this process's heartbeat went stale (a stall longer than "
                            "%s); both runs may now write to the folder: stop one of them", self.folder, self.path,
                            _describe(holder), STALE_ENV)
                return False
            try:
                replaced = os.fstat(self._fd).st_ino != os.stat(self.path).st_ino
            except FileNotFoundError:
                replaced = True
            if replaced:
                log.warning("%s: its lock file %s was deleted or replaced while this process held it; the folder is no "
                            "longer protected from a second run", self.folder, self.path)
                return False
            self._write_fd(self._fd)
            return True

    def release(self) -> None:
        self._stop.set()
        with self._mutex:
            fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._is_ours(self._read_fd(fd)):
                self.path.unlink(missing_ok=True)  # unlinked while still flocked: a waiting opener retries (inode check)
        finally:
            os.close(fd)
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
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return {}
        try:
            return self._read_fd(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _read_fd(fd: int) -> dict:
        """The record in the lock file ({} when empty); a read that races a heartbeat's rewrite is retried."""
        for attempt in range(3):
            try:
                data = os.pread(fd, 65536, 0)
                holder = json.loads(data or b"{}")
                return holder if isinstance(holder, dict) else {}
            except ValueError:
                time.sleep(0.05 * (attempt + 1))
            except OSError:
                return {}
        return {}

    def _write_fd(self, fd: int) -> None:
        """Write our record with a fresh heartbeat: in place at one length, so a reader never sees an empty file."""
        text = json.dumps({**self._record, "heartbeat": round(time.time(), 3)})
        if len(text) + 1 > self._size:
            self._size = len(text) + 1 + _PAD
            os.ftruncate(fd, 0)
        os.pwrite(fd, (text.ljust(self._size - 1) + "\n").encode(), 0)
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
