"""Where the spool's shared objects live (cache.spool_transport): the records, the plan, the trainers' positions, the
producers' heartbeats and the trainers' done marks. Each is a named blob that one side writes whole and the other
reads whole, so a spool needs only: put (atomic), get, delete, exists.

* `file` (FileChannel): one file per object in the spool folder: local disk, or a filesystem every node mounts.
* `mooncake` (MooncakeChannel): objects in a Mooncake store (the transfer engine and store SpecForge, TorchSpec and
  vLLM's speculators use across nodes), for producers and trainers on nodes that share no filesystem. Each producer
  lends the store a memory segment of its share of cache.spool_gb and its records are placed there, hard-pinned
  (never evicted); a trainer lends a small one for its control objects. Records travel over TCP or RDMA
  (cache.mooncake_protocol). A killed producer's records leave with its segment; the restarted producer makes again
  what the trainer has not read, as with the folder.

What stays on each machine's disk either way: the producers' logs and the recipe they were started with, and each
rank's ledger (its spool folder, cache.spool_dir).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

from deepspec.diskfull import room_for
from deepspec.errors import CacheError
from deepspec.log import get_logger

log = get_logger(__name__)

MAX_PRODUCERS = 256  # heartbeats are found by name (a store cannot list): producer.0 .. producer.255


class FileChannel:
    """Spool objects as files of one folder; writes go to a temporary name and are renamed when complete."""

    kind = "file"

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    @property
    def where(self) -> str:
        return str(self.folder)

    def put(self, name: str, data: bytes, *, durable: bool = False, what: str = "the spool object") -> None:
        path = self.folder / name
        tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
        # a full disk below the spool's cap (the cap counts the spool, not its neighbours): one sentence, no partial file
        with room_for(path, len(data), what, "Free space on the spool's disk (or lower cache.spool_gb) and restart the "
                      "producer: it continues where the trainer is.", cleanup=lambda: tmp.unlink(missing_ok=True)):
            with open(tmp, "wb") as f:
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)

    def get(self, name: str) -> bytes | None:
        try:
            return (self.folder / name).read_bytes()
        except FileNotFoundError:
            return None

    def delete(self, name: str) -> None:
        (self.folder / name).unlink(missing_ok=True)

    def exists(self, name: str) -> bool:
        return (self.folder / name).exists()

    def exists_many(self, names: list[str]) -> list[bool]:
        return [(self.folder / n).exists() for n in names]

    def delete_matching(self, prefix: str) -> None:
        for p in self.folder.glob(f"{prefix}*"):
            p.unlink(missing_ok=True)

    def size(self, name: str) -> int:
        try:
            return (self.folder / name).stat().st_size
        except FileNotFoundError:
            return 0

    def names(self, prefix: str, suffix: str) -> list[str]:
        """Object names that start with `prefix` and end with `suffix` (no temporaries)."""
        return sorted(p.name for p in self.folder.glob(f"{prefix}*{suffix}") if not p.name.startswith("."))

    def drop_temporaries(self, suffix: str) -> None:
        for tmp in self.folder.glob(f".*{suffix}.*.tmp"):
            tmp.unlink(missing_ok=True)

    def close(self) -> None:
        pass


def _preload_ibverbs() -> None:
    """Mooncake's store library links libibverbs (and its libnl) even for TCP. Machines without the system package get
    them from scripts/setup.sh in <venv>/lib/deepspec-sys; loading them first by path lets the store library link."""
    folder = Path(os.environ.get("DEEPSPEC_SYS_LIBS", Path(sys.prefix) / "lib" / "deepspec-sys"))
    for name in ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1"):
        for p in (folder / name, *folder.glob(f"**/{name}")):
            if p.exists():
                ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL)
                break


def import_mooncake():
    """(MooncakeDistributedStore, ReplicateConfig), or a sentence saying what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as e:
        if "libibverbs" not in str(e) and "libnl" not in str(e):
            raise CacheError("cache.spool_transport=mooncake needs the Mooncake store: `pip install mooncake-transfer-engine` "
                             "(GPU nodes) or `mooncake-transfer-engine-non-cuda` (scripts/setup.sh installs it).") from e
        _preload_ibverbs()
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as e2:
            raise CacheError(f"The Mooncake store library cannot load ({e2}); install the system package libibverbs1 "
                             "(or rerun scripts/setup.sh, which unpacks it into the virtual environment).") from e2
    return MooncakeDistributedStore, ReplicateConfig


class MooncakeChannel:
    """Spool objects in a Mooncake store under `<prefix>/`: this process mounts a segment of `segment_bytes` and puts
    its objects there, hard-pinned; reads pull from whichever process holds them."""

    kind = "mooncake"

    def __init__(self, *, master: str, metadata: str, prefix: str, segment_bytes: int, buffer_bytes: int,
                 protocol: str = "tcp", device: str = "", host: str | None = None):
        self.master, self.metadata, self.prefix = master, metadata, prefix.strip("/")
        self.segment_bytes, self.buffer_bytes = int(segment_bytes), int(buffer_bytes)
        self.protocol, self.device = protocol, device
        self.host = host or _reachable_host(master)
        self._store = None
        self._config = None

    @property
    def where(self) -> str:
        return f"mooncake://{self.master}/{self.prefix}"

    def _client(self):
        if self._store is None:
            Store, Replicate = import_mooncake()
            store = Store()
            rc = store.setup(self.host, self.metadata, self.segment_bytes, self.buffer_bytes, self.protocol, self.device, self.master)
            if rc != 0:
                raise CacheError(f"Could not join the Mooncake store (master {self.master}, metadata {self.metadata}) from "
                                 f"{self.host}: setup returned {rc}. Start `mooncake_master` (docs/data.md) and check "
                                 "cache.mooncake_master / cache.mooncake_metadata.")
            cfg = Replicate()
            cfg.preferred_segment = store.get_hostname()  # this process's own segment: its objects leave with it
            cfg.with_hard_pin = True  # the spool's cap bounds what is stored; the store must never evict a record
            self._store, self._config = store, cfg
        return self._store

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def put(self, name: str, data: bytes, *, durable: bool = False, what: str = "the spool object") -> None:
        store = self._client()
        for attempt in range(50):
            rc = store.upsert(self._key(name), data, self._config)
            if rc == 0:
                return
            if len(data) > self.buffer_bytes:
                break
            time.sleep(0.1 * min(attempt + 1, 10))  # a segment still freeing what the trainer deleted
        raise CacheError(f"The Mooncake store refused {what} {name} ({len(data):,} bytes, code {rc}) at {self.where}: this "
                         f"process lends {self.segment_bytes:,} bytes and stages {self.buffer_bytes:,}; raise cache.spool_gb "
                         "or check the master's log.")

    def get(self, name: str) -> bytes | None:
        data = self._client().get(self._key(name))
        return bytes(data) if data else None  # empty: not there (or its holder just died: it is made again)

    def delete(self, name: str) -> None:
        self._client().remove(self._key(name), True)  # force: a reader's lease must not keep a consumed record

    def exists(self, name: str) -> bool:
        return self._client().is_exist(self._key(name)) == 1

    def exists_many(self, names: list[str]) -> list[bool]:
        if not names:
            return []
        return [r == 1 for r in self._client().batch_is_exist([self._key(n) for n in names])]  # one round trip

    def delete_matching(self, prefix: str) -> None:
        import re

        self._client().remove_by_regex("^" + re.escape(self._key(prefix)), True)

    def size(self, name: str) -> int:
        n = self._client().get_size(self._key(name))
        return max(int(n), 0)

    def names(self, prefix: str, suffix: str) -> list[str]:
        """Only heartbeats are listed, and a store cannot list: probe producer.0 .. producer.MAX_PRODUCERS-1."""
        if prefix != "producer.":
            raise CacheError(f"internal: a Mooncake spool cannot list {prefix}*{suffix}")
        names = [f"{prefix}{w}{suffix}" for w in range(MAX_PRODUCERS)]
        found = self._client().batch_is_exist([self._key(n) for n in names])
        return [n for n, ok in zip(names, found) if ok == 1]

    def drop_temporaries(self, suffix: str) -> None:
        pass  # a put is all or nothing

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_store"] = state["_config"] = None  # each process joins the store itself
        return state


def _reachable_host(master: str) -> str:
    """This machine's address as the master sees it: the local end of a socket towards the master (no packet sent)."""
    import socket

    host = master.rsplit(":", 1)[0]
    if host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 1))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def open_channel(cfg, folder: Path, *, role: str, share_bytes: int = 0, largest_record: int = 0):
    """The spool's channel for this process. `role`: "producer" lends the store its share of the cap; "trainer" a
    small segment for its positions and marks."""
    if getattr(cfg.cache, "spool_transport", "file") != "mooncake":
        return FileChannel(folder)
    cc = cfg.cache
    control = 16 << 20
    segment = control + (int(share_bytes * 1.25) if role == "producer" else 0)  # headroom: the store's allocator rounds
    buffer = max(control, 2 * int(largest_record) + (1 << 20))  # a put or get stages the whole object here
    prefix = f"deepspec/{cfg.project}/{cfg.run_name}"
    return MooncakeChannel(master=cc.mooncake_master, metadata=cc.mooncake_metadata, prefix=prefix, segment_bytes=segment,
                           buffer_bytes=buffer, protocol=cc.mooncake_protocol, device=cc.mooncake_device, host=cc.mooncake_host or None)
