"""vLLM capture backend (extract_hidden_states) on the embedded SmolLM2: same cache format, same
tokens and masks, features equal to the HF backend's within fp32 round-off."""

from __future__ import annotations

import json

import pytest
import torch

from deepspec.config import config_from_dict
from deepspec.data.cache import format as fmt
from deepspec.data.cache.reader import CacheDataset
from deepspec.data.cache.writer import build_cache, build_caches


@pytest.mark.slow
def test_vllm_capture_matches_hf(smollm2_dir, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from deepspec.data.cache import vllm_capture

    engines = []

    class CountedFeaturizer(vllm_capture.VLLMFeaturizer):  # the real engine, counted
        def __init__(self, *a, **k):
            engines.append(1)
            super().__init__(*a, **k)

    monkeypatch.setattr(vllm_capture, "VLLMFeaturizer", CountedFeaturizer)
    (tmp_path / "data").mkdir()
    convs = [
        [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "An apple is a common fruit."}],
        [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two, three, four, five."},
         {"role": "user", "content": "And back?"}, {"role": "assistant", "content": "Five, four, three, two, one."}],
        [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there! How can I help you today?"}],
    ]
    for name, rows in (("regenerated.jsonl", convs), ("regenerated.heldout.jsonl", convs[1:])):
        with open(tmp_path / "data" / name, "w") as f:
            for i, c in enumerate(rows):
                f.write(json.dumps({"id": f"c{i}", "conversations": c}) + "\n")
    dirs = {}
    for backend in ("hf", "vllm"):
        cfg = config_from_dict({
            "target": {"name": str(smollm2_dir)},
            "data": {"dir": str(tmp_path / "data")},
            "cache": {"dir": str(tmp_path / backend), "dtype": "fp32", "capture_backend": backend, "max_length": 256},
        })
        if backend == "hf":
            dirs[backend] = build_cache(cfg, "train")
        else:  # both splits through one engine
            dirs[backend], held = build_caches(cfg, ["train", "heldout"])
    assert len(engines) == 1
    assert len(CacheDataset(held)) == 2 and fmt.load_manifest(held)["capture_backend"] == "vllm"
    m = fmt.load_manifest(dirs["vllm"])
    assert m["capture_backend"] == "vllm" and m["taps"] == [1, 14, 26]
    hf, vl = CacheDataset(dirs["hf"]), CacheDataset(dirs["vllm"])
    assert len(hf) == len(vl) == 3
    for i in range(3):
        a, b = hf[i], vl[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for key in ("taps", "final_hidden"):
            rel = ((b[key] - a[key]).norm(dim=-1) / a[key].norm(dim=-1)).max()
            assert rel < 1e-3, (key, float(rel))
    assert torch.equal(hf.token_counts(), vl.token_counts())
