"""bench_draft_memory.py's CPU estimate: taking matrix products and attention from their meta kernels (no compute)
allocates exactly the bytes the computed step allocates, and the width fit runs end to end; drafts build under any
torch.device context (how --recipe builds on CUDA), and the measured path runs at a tiny size."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    return load_script("benchmarks/bench_draft_memory.py")


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


def test_drafts_build_under_any_device_context():
    """A draft with a draft vocabulary built under `with torch.device(...)` (how --recipe builds on CUDA) has every
    tensor on that device, d2t / t2d included; before, build_draft_vocab mixed the context's device with the CPU."""
    import torch

    from deepspec.config.model import ModelConfig
    from deepspec.drafts import get_algorithm
    from deepspec.drafts.vocab import build_draft_vocab
    from deepspec.targets import tiny_config

    cfg = ModelConfig(algorithm="eagle3", target_layer_ids=[0, 2, 4], draft_vocab_size=100)
    with torch.device("meta"):
        draft = get_algorithm("eagle3").from_target_config(tiny_config("qwen3"), cfg)
        d2t, t2d = build_draft_vocab(torch.arange(320.0), 100)
    assert {t.device.type for t in [*draft.parameters(), *draft.buffers()]} == {"meta"}
    assert draft.d2t.shape == (100,) and draft.t2d.shape == (320,)
    assert d2t.device.type == t2d.device.type == "meta" and d2t.shape == (100,)
    # outside a context: on the CPU, with the same values whatever device the counts come from
    counts = torch.arange(320.0).flip(0)
    d2t, t2d = build_draft_vocab(counts, 100)
    assert d2t.device.type == "cpu" and torch.equal(d2t, torch.zeros(100, dtype=torch.int64))
    assert torch.equal(t2d.nonzero().flatten(), torch.arange(100))


def test_recipe_draft_builds_on_meta_and_the_measured_step_runs(one_torch_thread):
    """bench_draft_memory --recipe's builds: the DeepSeek-V4-Flash DFlash recipe's real-size draft on meta (its
    state counted exactly) and its measured path (built under a device context, the recipe's Muon, two steps) at a
    tiny width and length on the CPU."""
    from deepspec.config import load_config

    bench = _bench()
    recipe = str(ROOT / "config/dflash/deepseek-v4-flash.yaml")
    draft, _ = bench.build_recipe_draft(load_config(recipe), 1.0, "meta")
    assert draft.d2t.device.type == "meta" and draft.d2t.shape == (32000,)
    state = bench.state_bytes(draft, load_config(recipe), 8)
    assert state["trainable_params"] > 1.5e9 and state["frozen_bytes"] > 2e9
    cfg = load_config(recipe, bench._smoke_opts(recipe, []))
    assert cfg.cache.max_length == 64 and cfg.model.num_anchors == 4
    out = bench.measured_step(cfg, "cpu", bench.SMOKE_FACTOR)
    assert out["measured_on"] == "cpu" and out["measured_peak_gb"] > 0
