"""SGLang's runner for `deepspec check`: the classes each algorithm is checked against, and one SGLang process per
deepspec process (`SglangWorker`: `python -m deepspec.export.check_sglang SIDE_DIR`, the code that runs in SGLang's
own process, fed job files on stdin) through which `run_sglang` sends every job.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

SGLANG_CLASSES = {"eagle3": "sglang.srt.models.llama_eagle3.LlamaForCausalLMEagle3", "dflash": "sglang.srt.models.dflash.DFlashDraftModel",
                  "dspark": "sglang.srt.models.dspark.Qwen3DSparkModel"}


class MarkedLines:
    """The lines of a child's output that start with one of `marks`, read by a thread. Not select() on the pipe: one
    readline() pulls every line already written into the stream's buffer (a READY and an instant DONE together), and
    select() then waits for bytes that have already arrived, out to the job's timeout."""

    def __init__(self, stream, marks: tuple[str, ...]):
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._marks = marks
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            if line.startswith(self._marks):
                self._queue.put(line.strip())
        self._queue.put(None)  # the child closed its output: it has ended

    def next(self, deadline: float) -> str | None:
        """The next marked line; None past `deadline` (time.monotonic()) or once the child has ended."""
        import time

        try:
            return self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None


class SglangWorker:
    """One SGLang process per deepspec process (its import takes ~20 s on 2 cores), fed job files on stdin."""

    current: "SglangWorker | None" = None

    def __init__(self, side: Path):
        import atexit

        self.side = side
        self.log = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ)
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-m", "deepspec.export.check_sglang", str(side)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.lines = MarkedLines(self.proc.stdout, ("READY", "DONE"))
        atexit.register(self.close)

    @classmethod
    def get(cls, side: Path) -> "SglangWorker":
        w = cls.current
        if w is None or w.side != side or w.proc.poll() is not None:
            if w is not None:
                w.close()
            cls.current = w = cls(side)
        return w

    def run(self, job: str, timeout: float) -> str | None:
        """Send one job file; None = the process died or timed out (then the error text is in `failure`)."""
        import time

        try:
            self.proc.stdin.write(job + "\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.next(deadline)
            if line is None or line == f"DONE {job}":
                return line

    def failure(self) -> str:
        self.log.seek(0)
        return f"SGLang's process failed (exit {self.proc.poll()}): {self.log.read().strip()[-1500:]}"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001
                self.proc.kill()
        if SglangWorker.current is self:
            SglangWorker.current = None


def run_sglang(side: Path, jobs: list[tuple[Path, dict[str, torch.Tensor]]], timeout: float) -> list[dict[str, torch.Tensor]]:
    """Every (export, inputs) job through SGLang's code, in this process's SGLang worker."""
    with tempfile.TemporaryDirectory(prefix="deepspec-check-") as tmp:
        t = Path(tmp)
        worker = SglangWorker.get(side)
        results = []
        for i, (export, inputs) in enumerate(jobs):
            torch.save(inputs, t / f"inputs{i}.pt")
            job = {"export": str(export), "inputs": str(t / f"inputs{i}.pt"), "out": str(t / f"out{i}.pt")}
            (t / f"job{i}.json").write_text(json.dumps(job))
            if worker.run(str(t / f"job{i}.json"), timeout) is None:
                err = worker.failure() if worker.proc.poll() is not None else f"SGLang's process did not answer in {timeout:.0f} s"
                worker.close()
                results.append({"error": err})
                worker = SglangWorker.get(side)
                continue
            results.append(torch.load(t / f"out{i}.pt", weights_only=True))
        return results
