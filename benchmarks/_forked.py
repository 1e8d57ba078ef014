"""Run benchmark scripts each in its own process, forked from one that has imported torch and transformers once.

A smoke run of every script is mostly interpreter start-up: each fresh `python bench_x.py --smoke` spends 3-4 s of one
core importing torch, transformers and deepspec before seconds of work. Forking from a parent that imported them once
gives each script a process of its own (its own argv, environment, working directory, stdout and stderr, exit code)
without paying that again. Only for checks of the code paths (`run_all.py --smoke`): a measurement runs in a fresh
interpreter, as a user would start it. Linux only (fork); the caller falls back to fresh processes elsewhere.

Fork safety: the parent imports modules and nothing else - no torch op runs before a fork, so no OpenMP pool, thread
or lock is copied into a child mid-use - and forks from its only thread.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import tempfile
import time
import traceback
from pathlib import Path

# what most bench scripts import first; each costs every fresh interpreter seconds
PRELOAD = ("torch", "transformers", "safetensors.torch", "deepspec.config", "deepspec.drafts", "deepspec.train.loop",
           "deepspec.data.cache", "deepspec.targets")


def can_fork() -> bool:
    return hasattr(os, "fork") and sys.platform.startswith("linux")


def preload() -> None:
    """Import the heavy modules (and the Auto classes transformers loads lazily) in this process, once."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    transformers = sys.modules["transformers"]
    for name in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"):  # resolved on first access
        getattr(transformers, name)


def _child(script: Path, args: list[str], env: dict[str, str], cwd: Path, out: str, err: str) -> None:
    """In the forked process: become `python script *args` with `env` in `cwd`, then exit with its code."""
    code = 1
    try:
        for fd, path in ((1, out), (2, err)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        threads = env.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            import torch

            torch.set_num_threads(int(threads))  # read once by torch at import; the child's environment asks again
        sys.argv = [str(script), *args]
        sys.path[0] = str(script.parent)
        try:
            runpy.run_path(str(script), run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()  # what a normal interpreter exit runs (log handlers, temporary folders)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)


def run_forked(scripts: dict[str, tuple[Path, list[str]]], env: dict[str, str], cwd: Path, jobs: int,
               parse) -> dict[str, dict]:
    """{name: (script, args)} run `jobs` at a time, each in a forked child; {name: result} where result is what
    `parse(name, returncode, stdout, stderr, seconds)` makes of it."""
    sys.stdout.flush()
    sys.stderr.flush()
    tmp = Path(tempfile.mkdtemp(prefix="deepspec_forked_"))
    pending = list(scripts)
    running: dict[int, tuple[str, float]] = {}
    results: dict[str, dict] = {}
    while pending or running:
        while pending and len(running) < max(1, jobs):
            name = pending.pop(0)
            script, args = scripts[name]
            out, err = str(tmp / f"{name}.out"), str(tmp / f"{name}.err")
            t0 = time.monotonic()
            pid = os.fork()
            if pid == 0:
                _child(script, args, env, cwd, out, err)  # never returns
            running[pid] = (name, t0)
        pid, status = os.waitpid(-1, 0)
        if pid not in running:
            continue
        name, t0 = running.pop(pid)
        rc = os.waitstatus_to_exitcode(status)
        text = {k: (tmp / f"{name}.{k}").read_text(errors="replace") for k in ("out", "err")}
        results[name] = parse(name, rc, text["out"], text["err"], time.monotonic() - t0)
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    return results


if __name__ == "__main__":  # a check by hand: python benchmarks/_forked.py bench_plan --smoke
    here = Path(__file__).resolve().parent
    preload()
    res = run_forked({sys.argv[1]: (here / f"{sys.argv[1]}.py", sys.argv[2:])}, dict(os.environ), here.parent, 1,
                     lambda n, rc, o, e, s: {"rc": rc, "seconds": round(s, 1), "stdout_tail": o[-300:], "stderr_tail": e[-300:]})
    print(json.dumps(res, indent=2))
