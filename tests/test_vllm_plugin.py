"""deepspec's vLLM plugin (deepspec/vllm_plugin.py): vLLM's CPU build expands per-token temperatures into
uninitialised memory at T > 0, and its rms_norm reads only the first row of a per-layer weight (DFlash's context keys);
with the plugin, both are right. Its two speed-ups of a CPU server start: the engine process forked, and vLLM's model
class inspection run in the process that asks (no new interpreter), cached by vLLM as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from deepspec.vllm_plugin import expand_to_tokens

# what vLLM's rejection sampler does with per-request temperatures before verifying drafts at T > 0
PROBE = """
import json, torch
from vllm.platforms import current_platform as p
p.import_kernels()
from vllm.plugins import load_general_plugins
load_general_plugins()          # as vLLM's worker does, just before ...
p.register_triton_kernel_overrides()   # ... the CPU fallbacks are registered
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
temps = torch.tensor([1.0, 0.7, -1.0])   # -1: a greedy request (vLLM's GREEDY_TEMPERATURE) -> 1
out = expand_batch_to_tokens(temps, torch.tensor([3, 5, 6], dtype=torch.int32), 6, replace_from=-1, replace_to=1)
ids = expand_batch_to_tokens(torch.tensor([4, 9, 2]), torch.tensor([3, 5, 6], dtype=torch.int32), 6)
from vllm import _custom_ops as ops     # DFlash's context keys: one k_norm weight row per layer
k, w = torch.randn(3, 5, 2, 32, generator=torch.Generator().manual_seed(0)), torch.arange(1.0, 4.0)[:, None].repeat(1, 32)
normed = torch.empty_like(k)
ops.rms_norm(normed, k, w, 1e-6)
want = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * w[:, None, None, :]
inspected = None
if INSPECT:   # what vLLM asks of a model class it serves the first time (VLLM_CACHE_ROOT is a fresh folder)
    import os, subprocess
    from vllm.model_executor.models.registry import ModelRegistry
    started, run = [], subprocess.run
    subprocess.run = lambda *a, **k: started.append(a[0] if a else k.get("args")) or run(*a, **k)
    info = ModelRegistry.models["LlamaForCausalLM"].inspect_model_cls()
    cached = sorted(os.listdir(os.path.join(os.environ["VLLM_CACHE_ROOT"], "modelinfos")))
    inspected = {"processes": [str(c) for c in started], "cached": cached, "text_generation": info.is_text_generation_model}
print(json.dumps({"temperatures": out.tolist(), "ids": ids.tolist(), "inspected": inspected,
                  "rms_norm_err_per_layer": (normed - want).abs().flatten(1).max(1).values.tolist()}))
"""


def test_expand_to_tokens_matches_the_kernels_definition():
    out = torch.full((7,), float("nan"))
    expand_to_tokens(out, torch.tensor([1.0, 0.7, -1.0]), torch.tensor([3, 5, 6], dtype=torch.int32), -1, 1)
    assert out[:6].tolist() == pytest.approx([1.0, 1.0, 1.0, 0.7, 0.7, 1.0]) and torch.isnan(out[6])  # beyond cu[-1]: untouched
    ids = torch.zeros(4, dtype=torch.int64)
    expand_to_tokens(ids, torch.tensor([5, 0]), torch.tensor([1, 4]), 0, 8)
    assert ids.tolist() == [5, 8, 8, 8]


def _probe(fix: bool, cache_root=None) -> dict:
    env = dict(os.environ, DEEPSPEC_VLLM_CPU_FIX="1" if fix else "0")
    if cache_root:
        env["VLLM_CACHE_ROOT"] = str(cache_root)
    code = f"INSPECT = {bool(cache_root)}\n{PROBE}"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
def test_vllm_cpu_fixes_with_the_plugin(tmp_path):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the fix concerns vLLM's CPU build")
    fixed = _probe(fix=True, cache_root=tmp_path)
    assert fixed["temperatures"] == pytest.approx([1.0, 1.0, 1.0, 0.7, 0.7, 1.0])
    assert fixed["ids"] == [4, 4, 4, 9, 9, 2]  # integer expansion still runs vLLM's own kernel
    assert max(fixed["rms_norm_err_per_layer"]) < 1e-5, fixed
    # 4.: the class inspected without starting a process, and vLLM cached the answer as it does after its subprocess
    # (without the plugin it would start `python -m vllm.model_executor.models.registry`: ~5 s, not run here)
    inspected = fixed["inspected"]
    assert inspected["processes"] == [] and inspected["text_generation"] is True, inspected
    assert inspected["cached"] == ["vllm-model_executor-models-llama-LlamaForCausalLM.json"], inspected
    broken = _probe(fix=False)
    import vllm

    if vllm.__version__ == "0.32.0":  # the release the plugin was written against: without it the values are garbage
        assert broken["temperatures"] != pytest.approx([1.0, 1.0, 1.0, 0.7, 0.7, 1.0]), broken
        err = broken["rms_norm_err_per_layer"]  # layer 0 right, later layers normed with layer 0's weight
        assert err[0] < 1e-5 and min(err[1:]) > 0.5, broken


def test_the_engine_process_is_forked_only_when_asked_and_the_user_chose_no_method(monkeypatch):
    """3. (deepspec/vllm_plugin.py `_fork_engine_process`): after vLLM's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD
    to spawn, the plugin turns it into fork when deepspec's server asked (DEEPSPEC_VLLM_FORK_ENGINE=1, which
    VLLMServer.server_env sets on CPU unless the user exported a method: tests/test_regenerate.py); otherwise vLLM's
    choice stands. vLLM's own function is stubbed to what it does with the variable. (A real server's engine process is
    checked in tests/test_regenerate_vllm.py.)"""
    pytest.importorskip("vllm")
    from vllm.platforms.cpu import CpuPlatform

    from deepspec import vllm_plugin

    calls = []

    def vllm_sets_spawn(cls, vllm_config):
        calls.append(vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    def platform_after(env: dict[str, str]) -> str:
        monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(vllm_sets_spawn))
        for key in (vllm_plugin.FORK_ENGINE, "VLLM_WORKER_MULTIPROC_METHOD"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        vllm_plugin._fork_engine_process()
        vllm_plugin._fork_engine_process()  # vLLM loads plugins more than once per process: wrapped once
        CpuPlatform.check_and_update_config("config")
        return os.environ["VLLM_WORKER_MULTIPROC_METHOD"]

    assert platform_after({vllm_plugin.FORK_ENGINE: "1"}) == "fork"
    assert platform_after({vllm_plugin.FORK_ENGINE: "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}) == "fork"  # vLLM's own, set earlier
    assert platform_after({}) == "spawn"
    assert platform_after({vllm_plugin.FORK_ENGINE: "0"}) == "spawn"
    assert calls == ["config"] * 4  # vLLM's own update always runs, once per call
