"""bench_draft_memory.py's CPU estimate: taking matrix products and attention from their meta kernels (no compute)
allocates exactly the bytes the computed step allocates, and the width fit runs end to end."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_draft_memory", ROOT / "benchmarks" / "bench_draft_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("recipe", ["config/dflash/qwen3-4b.yaml", "config/eagle3/qwen3-4b.yaml"])
def test_shape_only_step_allocates_the_bytes_of_the_computed_step(recipe, one_torch_thread):
    from deepspec.config import load_config

    bench = _bench()
    opts = ["cache.max_length=96", "train.micro_batch_size=1", "model.draft_vocab_size=512"]
    if "dflash" in recipe:
        opts += ["model.num_anchors=6"]
    cfg = load_config(str(ROOT / recipe), opts)
    shape_only = bench.measure_activations(cfg, 1 / 64, "bf16", compute=False)
    computed = bench.measure_activations(cfg, 1 / 64, "bf16", compute=True)
    assert shape_only["gemm_attention_ops_shape_only"] > 0 and computed["gemm_attention_ops_emulated"] >= 0
    assert shape_only["activation_bytes"] == computed["activation_bytes"] > 0
    assert shape_only["sdpa_kernels"] == computed["sdpa_kernels"]
