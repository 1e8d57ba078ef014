"""One run per folder: a live holder (a real process) stops a second training run, cache build or regeneration at
once with one sentence naming it; a holder killed with SIGKILL leaves a lock that the next run takes over.

Shared filesystems are simulated in the holder's process by replacing the OS calls the lock makes (fault injection,
before deepspec is imported): `socket.gethostname` answers another node's name, and `fcntl.flock` either succeeds
without locking (a node-local flock: another node's lock is invisible here) or fails with ENOSYS (no flock at all)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# argv: folder, host ("-": this one), flock ("real", "node-local" or "enosys")
FAULTS = """
import errno, fcntl, socket, sys
if sys.argv[2] != "-":
    socket.gethostname = lambda: sys.argv[2]
if sys.argv[3] == "node-local":
    fcntl.flock = lambda fd, op: None
elif sys.argv[3] == "enosys":
    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")
    fcntl.flock = no_flock
from deepspec.log import setup_logging
setup_logging()
"""

HOLDER = FAULTS + """
import time
from deepspec.locks import FolderInUseError, FolderLock
try:
    FolderLock(sys.argv[1], "training run").acquire()
except FolderInUseError as e:
    print("refused:", e, flush=True)
    sys.exit(2)
print("locked", flush=True)
time.sleep(300)
"""

FAST = {"DEEPSPEC_LOCK_HEARTBEAT_S": "0.2", "DEEPSPEC_LOCK_STALE_S": "5"}  # holders beat 5 times a second


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **FAST, **extra}


def _record(folder: Path) -> dict:
    from deepspec.locks import lock_path

    return json.loads(lock_path(folder).read_text())


@pytest.fixture
def holder():
    """Start a process that holds the lock of a folder; yields start(folder, host, flock) -> Popen."""
    procs = []

    def start(folder: Path, host: str = "-", flock: str = "real", expect: str = "locked", **env: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), host, flock], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_env(**env))
        procs.append(proc)
        if expect:
            assert proc.stdout.readline().strip() == expect
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.parametrize("node", ["this host", "another node"])
def test_second_training_run_on_a_folder_in_use_stops_at_once_naming_the_holder(tmp_path, holder, node):
    """On this host the flock refuses; a holder on another node (whose flock is node-local, so ours succeeds) is
    refused by its fresh heartbeat, with the same sentence and exit status."""
    from deepspec.config import load_config, save_config

    cfg = load_config(REPO / "config/quickstart/eagle3.yaml", [f"train.output_root={tmp_path / 'ckpt'}", "run.name=busy"])
    recipe = save_config(cfg, tmp_path, "recipe.yaml")
    host = socket.gethostname() if node == "this host" else "node-b"
    proc = holder(cfg.run_dir, *(("-", "real") if node == "this host" else ("node-b", "node-local")))
    second = subprocess.run([sys.executable, "-m", "deepspec.cli", "train", str(recipe)], capture_output=True, text=True,
                            timeout=120, env=_env(CUDA_VISIBLE_DEVICES=""))
    assert second.returncode == 2
    line = [ln for ln in second.stderr.splitlines() if ln.startswith("deepspec: error:")]
    assert len(line) == 1 and f"is in use by another training run: pid {proc.pid} on host {host} (started " in line[0]
    assert "heartbeat " in line[0] and " s ago" in line[0]
    assert not (cfg.run_dir / "config.yaml").exists()  # it wrote nothing


def test_cache_build_and_regeneration_refuse_a_folder_in_use(tmp_path, holder, tiny_llama_dir):
    from deepspec.config import load_config
    from deepspec.data.cache import build_cache
    from deepspec.data.regenerate import regenerate
    from deepspec.locks import FolderInUseError

    cfg = load_config(None, [f"target.name={tiny_llama_dir}", f"data.dir={tmp_path / 'data'}", f"cache.dir={tmp_path / 'cache'}"])
    proc = holder(cfg.cache_train_dir)
    with pytest.raises(FolderInUseError, match=f"pid {proc.pid}"):
        build_cache(cfg, "train")
    proc = holder(cfg.data_dir)
    with pytest.raises(FolderInUseError, match=f"{cfg.data_dir.name} is in use by another training run: pid {proc.pid}"):
        regenerate(cfg)


def test_lock_of_a_killed_holder_is_taken_over_with_a_warning(tmp_path, holder, logs):
    from deepspec.locks import FolderLock, lock_path

    folder = tmp_path / "run"
    proc = holder(folder)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert lock_path(folder).is_file()  # SIGKILL leaves the file behind
    with FolderLock(folder, "training run"):
        pass
    assert any(f"taking over the lock of pid {proc.pid}" in r.getMessage() for r in logs.records)
    assert not lock_path(folder).exists()  # released cleanly this time


def test_eval_and_export_refuse_an_output_folder_in_use(tmp_path, holder, tiny_llama_dir):
    from random_drafts import random_draft_checkpoint

    from deepspec.config import load_config
    from deepspec.eval.runner import evaluate
    from deepspec.export.writers import export_draft
    from deepspec.locks import FolderInUseError

    _, ckpt = random_draft_checkpoint(tmp_path / "run" / "step_2", "llama", "eagle3")
    out = tmp_path / "exports" / "e3"
    export_draft(ckpt, out)
    before = (out / "model.safetensors").read_bytes()
    proc = holder(out)
    with pytest.raises(FolderInUseError, match=f"e3 is in use by another training run: pid {proc.pid}"):
        export_draft(ckpt, out)
    assert (out / "model.safetensors").read_bytes() == before and not list(out.parent.glob(".e3.tmp-*"))
    from deepspec import cli

    assert cli.main(["export", str(ckpt), "--out", str(out), "--skip-check"]) == 2  # the command: the same refusal
    assert (out / "model.safetensors").read_bytes() == before and sorted(p.name for p in out.parent.iterdir()) == [".e3.lock", "e3"]
    proc.kill()
    proc.wait()
    export_draft(ckpt, out)  # the lock of the killed holder is taken over
    assert (out / "model.safetensors").read_bytes() == before and sorted(p.name for p in out.parent.iterdir()) == ["e3"]
    cfg = load_config(None, [f"target.name={tiny_llama_dir}", "eval.tasks=[mt_bench]", "eval.max_samples=1"])
    proc = holder(tmp_path / "ev")
    with pytest.raises(FolderInUseError, match=f"ev is in use by another training run: pid {proc.pid}"):
        evaluate(cfg, ckpt, output_dir=tmp_path / "ev")
    assert not list((tmp_path / "ev").iterdir())  # it wrote nothing


def test_a_live_holders_heartbeat_advances_and_a_stalled_one_on_another_node_is_taken_over(tmp_path, holder, logs, monkeypatch):
    """A holder on another node rewrites its heartbeat while it runs; stopped (SIGSTOP: a hung node) past the staleness
    limit, its lock is taken over with a warning naming it and its heartbeat's age, and once it runs again it sees
    that it lost the lock and leaves the file alone."""
    from deepspec.locks import FolderInUseError, FolderLock, lock_path

    monkeypatch.setenv("DEEPSPEC_LOCK_HEARTBEAT_S", "0.2")
    monkeypatch.setenv("DEEPSPEC_LOCK_STALE_S", "1.5")
    folder = tmp_path / "run"
    proc = holder(folder, "node-b", "node-local", DEEPSPEC_LOCK_STALE_S="1.5")
    first = _record(folder)
    time.sleep(0.7)
    later = _record(folder)
    assert first["host"] == later["host"] == "node-b" and first["pid"] == later["pid"] == proc.pid
    assert later["heartbeat"] - first["heartbeat"] >= 0.3 and later["started"] == first["started"]  # refreshed, nothing else
    with pytest.raises(FolderInUseError, match=f"in use by another training run: pid {proc.pid} on host node-b"):
        FolderLock(folder, "training run").acquire()  # fresh: refused

    proc.send_signal(signal.SIGSTOP)
    stopped_beat = _record(folder)["heartbeat"]
    time.sleep(1.8)
    assert _record(folder)["heartbeat"] == stopped_beat  # a stopped holder's heartbeat stands still
    with FolderLock(folder, "training run"):
        took = sorted({r.getMessage() for r in logs.records if "taking over the lock" in r.getMessage()})
        assert len(took) == 1 and f"of pid {proc.pid} on host node-b (started " in took[0]
        age = float(took[0].split("whose heartbeat is ")[1].split(" s old")[0])
        assert 1.5 <= age < 10
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.8)  # four of the holder's heartbeats
        assert _record(folder)["pid"] == os.getpid() and _record(folder)["host"] == socket.gethostname()
    assert not lock_path(folder).exists()
    proc.kill()
    _, err = proc.communicate(timeout=10)
    assert f"was taken over by pid {os.getpid()} on host {socket.gethostname()}" in err


def _try_lock(folder: Path, host: str = "-") -> subprocess.CompletedProcess:
    """Another process on a filesystem without flock takes the lock and releases it at once."""
    code = FAULTS + """
from deepspec.locks import FolderInUseError, FolderLock
try:
    with FolderLock(sys.argv[1], "cache build"):
        print("acquired", flush=True)
except FolderInUseError as e:
    print("refused:", e, flush=True)
    sys.exit(2)
"""
    return subprocess.run([sys.executable, "-c", code, str(folder), host, "enosys"], capture_output=True, text=True,
                          timeout=60, env=_env())


def test_without_flock_the_heartbeat_holds_the_lock(tmp_path, holder):
    """flock failing with ENOSYS (Lustre noflock) is one warning, not a traceback; the lock still refuses a second
    holder on this host (live pid) and on another node (fresh heartbeat), is taken over once its holder is killed,
    and of two holders starting at once exactly one gets it."""
    folder = tmp_path / "cache"
    proc = holder(folder, "-", "enosys")
    beat = _record(folder)["heartbeat"]
    for host in ("-", "node-c"):
        second = _try_lock(folder, host)
        assert second.returncode == 2, second.stderr
        assert f"refused: {folder} is in use by another training run: pid {proc.pid} on host {socket.gethostname()}" in second.stdout
        assert "Traceback" not in second.stderr and second.stderr.count("has no flock (ENOSYS)") == 1
    time.sleep(0.5)
    assert _record(folder)["heartbeat"] - beat >= 0.2 and _record(folder)["pid"] == proc.pid  # still beating
    proc.kill()
    proc.wait()
    assert proc.stderr.read().count("has no flock (ENOSYS); its folder locks rest on their heartbeat alone") == 1
    third = _try_lock(folder)
    assert third.returncode == 0 and third.stdout.strip() == "acquired", third.stderr
    assert f"taking over the lock of pid {proc.pid} on host {socket.gethostname()}" in third.stderr

    racers = [holder(tmp_path / "race", "-", "enosys", expect="") for _ in range(2)]
    outcomes = sorted(p.stdout.readline().split(":")[0].strip() for p in racers)
    assert outcomes == ["locked", "refused"]


def test_lock_timing_settings_are_checked(monkeypatch, tmp_path):
    from deepspec.errors import ConfigError
    from deepspec.locks import FolderLock

    monkeypatch.setenv("DEEPSPEC_LOCK_STALE_S", "40")  # not more than twice the default 30 s heartbeat
    with pytest.raises(ConfigError, match="DEEPSPEC_LOCK_STALE_S=40 must be more than twice DEEPSPEC_LOCK_HEARTBEAT_S=30"):
        FolderLock(tmp_path / "x", "training run").acquire()
    monkeypatch.setenv("DEEPSPEC_LOCK_HEARTBEAT_S", "soon")
    with pytest.raises(ConfigError, match="DEEPSPEC_LOCK_HEARTBEAT_S='soon' is not a positive number of seconds"):
        FolderLock(tmp_path / "x", "training run").acquire()
