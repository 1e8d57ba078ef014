"""Run one measurement in a process group of its own, and kill the whole tree when it runs out of time.

`subprocess.run(timeout=...)` kills only the direct child: a torchrun worker (which torch's launcher starts in a
session of its own), torch.compile's worker pool or a data-loader process lives on, holding the GPU while the next
measurement starts. `run_group` starts the command with a new session, and on timeout sends SIGTERM to its group
(torchrun then stops its workers itself), waits `grace_s`, then SIGKILLs its group and the group of every process
that descended from it, found through /proc before and after the SIGTERM.

As a command (benchmarks/gpu_check.sh runs each row through it), one row of a check run under a time limit:

    python benchmarks/_procs.py --name ROW --limit SECONDS --jsonl ROWS.jsonl --log LOG.txt -- COMMAND ...

runs COMMAND in a process group of its own, appends its stdout and stderr to LOG.txt (under a header naming the row)
and one status line to ROWS.jsonl: {"benchmark": "gpu_check", "row": ROW, "status": "ok" | "error" | "timeout" |
"skipped", "wall_s", "limit_s", "rc", "error"}. A limit under --min-s writes a "skipped" line without running
anything. It always exits 0, so that a failing row never stops the rows after it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


class GroupTimeout(RuntimeError):
    """The command ran past its time; every process of its tree was killed. stdout / stderr: what it had printed."""

    def __init__(self, message: str, stdout: str = "", stderr: str = ""):
        super().__init__(message)
        self.stdout, self.stderr = stdout, stderr


def pythonpath_with(first: Path | str) -> str:
    """PYTHONPATH for a child that must import `first`'s deepspec, keeping what this process's PYTHONPATH adds after
    it: gpu_check.sh puts Liger-Kernel's wheel there for our rows (replacing PYTHONPATH lost it: an H200 run's
    EAGLE-3 rows trained with the eager loss although Liger was installed)."""
    rest = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(x for x in [str(first), rest] if x)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren, ...), from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and parentheses
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _signal_groups(pids: list[int], sig: int) -> None:
    groups = set()
    for p in pids:
        try:
            groups.add(os.getpgid(p))
        except ProcessLookupError:
            continue
    groups.discard(os.getpgid(0))  # never our own group
    for g in groups:
        try:
            os.killpg(g, sig)
        except ProcessLookupError:
            pass


def kill_tree(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the command's group, then SIGKILL it and every descendant's group (see the module docstring)."""
    tree = [proc.pid, *descendants(proc.pid)]
    _signal_groups(tree, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    tree += descendants(proc.pid) if proc.poll() is None else []
    _signal_groups(tree, signal.SIGKILL)
    proc.wait()


def run_group(cmd: list[str], timeout: float, *, env: dict[str, str] | None = None, stdout_path: Path | None = None,
              stderr_path: Path | None = None, grace_s: float = 30.0) -> Finished:
    """Run `cmd` in a new session; its output (kept in files, not pipes, so a killed tree can never block us).
    Raises GroupTimeout after killing the whole tree when it runs past `timeout` seconds."""
    import tempfile

    tmp = None
    if stdout_path is None or stderr_path is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-proc-")
        stdout_path = stdout_path or Path(tmp.name) / "out"
        stderr_path = stderr_path or Path(tmp.name) / "err"
    stdout_path.parent.mkdir(parents=True, exist_ok=True)
    stderr_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        with open(stdout_path, "w") as out, open(stderr_path, "w") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_tree(proc, grace_s)
                raise GroupTimeout(f"{Path(cmd[1]).name if len(cmd) > 1 else cmd[0]} ran past its {timeout:.0f} s and was "
                                   f"killed with its whole process tree", stdout_path.read_text(), stderr_path.read_text()) from None
            except BaseException:  # Ctrl-C etc.: leave nothing running behind us
                kill_tree(proc, grace_s=5.0)
                raise
        return Finished(proc.returncode, stdout_path.read_text(), stderr_path.read_text(), time.perf_counter() - t0)
    finally:
        if tmp is not None:
            tmp.cleanup()


def last_error(stderr: str, n: int = 3) -> str:
    """The last lines of a failed command's stderr that name an error (else its last lines)."""
    import re

    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"\w+(Error|Exception)\b|error:", ln) and "elastic" not in ln and "ChildFailedError" not in ln]
    return " | ".join((errors or lines)[-n:])


def append_line(path: Path, obj: dict) -> None:
    """One JSON line appended to `path`, on disk (flushed, fsynced) before anything else runs."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_row(name: str, cmd: list[str], limit: float, jsonl: Path, log: Path, min_s: float = 10.0, grace_s: float = 10.0) -> dict:
    """Run one row of a check (see the module docstring); its status line (also appended to `jsonl`)."""
    import tempfile

    status: dict = {"benchmark": "gpu_check", "row": name, "limit_s": round(limit, 1)}
    if limit < min_s:
        status.update(status="skipped", why=f"the check's time is spent: {max(0.0, limit):.0f} s left, a row needs at least {min_s:.0f} s")
        append_line(jsonl, status)
        return status
    with tempfile.TemporaryDirectory(prefix="gpu-check-row-") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        t0 = time.perf_counter()
        try:
            # the row's own limit, for a command that splits it among children (bench_train.py: each row's child
            # is killed in time for the command to write that row's error, where it got to, before this kills it)
            env = dict(os.environ, BENCH_TIME_LIMIT_S=f"{max(0.0, limit - grace_s):.0f}")
            done = run_group(cmd, limit, env=env, stdout_path=out, stderr_path=err, grace_s=grace_s)
            rc, stdout, stderr = done.returncode, done.stdout, done.stderr
            status.update(status="ok" if rc == 0 else "error", rc=rc)
            if rc != 0:
                status["error"] = last_error(stderr) or f"exit {rc}"
        except GroupTimeout as e:
            stdout, stderr = e.stdout, e.stderr
            status.update(status="timeout", rc=None, error=f"{e} (the rows it finished are above)")
        except OSError as e:  # the command does not exist / cannot start
            stdout, stderr = "", str(e)
            status.update(status="error", rc=None, error=f"{type(e).__name__}: {e}")
        status["wall_s"] = round(time.perf_counter() - t0, 1)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"===== {name}: {status['status']} in {status['wall_s']} s (limit {limit:.0f} s): {' '.join(cmd)}\n")
        f.write(stdout)
        if stderr:
            f.write(("" if not stdout or stdout.endswith("\n") else "\n") + "----- stderr\n" + stderr)
        f.write("\n")
    append_line(jsonl, status)
    return status


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Run one row of a check in a process group of its own, under a time limit.")
    p.add_argument("--name", required=True)
    p.add_argument("--limit", type=float, required=True, help="seconds; past them the whole process tree is killed")
    p.add_argument("--jsonl", required=True, help="append the row's status line here")
    p.add_argument("--log", required=True, help="append the command's stdout and stderr here")
    p.add_argument("--min-s", type=float, default=10.0, help="below this limit the row is skipped")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error("no command given after --")
    status = run_row(a.name, cmd, a.limit, Path(a.jsonl), Path(a.log), a.min_s)
    print(f"[gpu_check] {a.name}: {status['status']}" + (f" in {status['wall_s']} s" if "wall_s" in status else "")
          + (f": {status.get('error') or status.get('why')}" if status["status"] != "ok" else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
