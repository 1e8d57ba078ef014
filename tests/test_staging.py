"""Staging batches on the training device: features in the dtype the model trains in (bf16 under bf16 training, so
they are not widened to fp32 only for autocast to round them back), unchanged fp32 staging where training runs in
fp32, and packed batches made page-locked once on CUDA."""

from __future__ import annotations

import pytest
import torch

from deepspec.config.model import ModelConfig
from deepspec.drafts import get_algorithm
from deepspec.drafts.base import dequantize
from deepspec.drafts.checkpoint import target_weights
from deepspec.targets import capture, tiny_target
from deepspec.data.batches import collate_features, pack_features, packing
from deepspec.train.staging import DeviceStager, feature_dtype


def test_features_are_staged_in_the_training_dtype(monkeypatch):
    import deepspec.cpus

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert feature_dtype("auto", gpu) == torch.bfloat16 and feature_dtype("auto", cpu) == torch.float32
    assert feature_dtype("bf16", cpu) == torch.bfloat16 and feature_dtype("fp32", gpu) == torch.float32
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):  # bf16 on CPUs only where it is native
        monkeypatch.setattr(deepspec.cpus, "cpu_has_native_bf16", lambda native=native: native)
        assert feature_dtype("bf16_if_native", cpu) == want


def _items(fp8: bool):
    g = torch.Generator().manual_seed(7)
    items = []
    for t in (6, 4, 9):
        x, f = torch.randn(t, 3, 8, generator=g), torch.randn(t, 8, generator=g)
        it = {"input_ids": torch.randint(0, 50, (t,), generator=g), "loss_mask": torch.rand(t, generator=g) > 0.3}
        if fp8:
            xs, fs = x.abs().amax(-1) / 448, f.abs().amax(-1) / 448
            it.update(taps=(x / xs[..., None]).to(torch.float8_e4m3fn), taps_scale=xs[..., None],
                      final_hidden=(f / fs[:, None]).to(torch.float8_e4m3fn), final_scale=fs)
        else:
            it.update(taps=x.to(torch.bfloat16), final_hidden=f.to(torch.bfloat16))
        items.append(it)
    return items


@pytest.mark.parametrize("fp8", [False, True])
def test_cpu_stager_converts_features_to_its_dtype_and_keeps_fp32_as_before(fp8):
    items = _items(fp8)
    plan = [(0, 0, collate_features(items[:2])), (0, 1, collate_features(items[1:]))]
    for dtype in (torch.float32, torch.bfloat16):
        got = list(DeviceStager(iter(plan), torch.device("cpu"), dtype))
        assert [(s, m) for s, m, *_ in got] == [(0, 0), (0, 1)]
        for (_, _, src), (_, _, batch, n_tok, n_real) in zip(plan, got):
            assert batch.taps.dtype == dtype and batch.final_hidden.dtype == dtype and batch.taps_scale is None
            assert torch.equal(batch.taps, dequantize(src.taps, src.taps_scale, dtype))
            assert n_tok == int(src.loss_mask.sum()) and n_real == int(src.attention_mask.sum())
            if dtype == torch.float32:  # what the stager always did
                assert torch.equal(batch.final_hidden, src.to("cpu", torch.float32).final_hidden)


@pytest.mark.parametrize("algorithm", ["eagle3", "dflash", "dspark"])
def test_bf16_staged_features_give_bf16_training_the_same_loss_and_gradients(algorithm):
    """Under bf16 autocast the drafts round their feature inputs to bf16 anyway: features of a bf16 cache staged in
    bf16 give exactly the loss and gradients that the same features staged in fp32 gave."""
    torch.manual_seed(0)
    model, _ = tiny_target("qwen3" if algorithm != "eagle3" else "llama")
    cfg = ModelConfig(algorithm=algorithm, target_layer_ids=[0, 2, 4], block_size=4, num_anchors=3, markov_rank=8, ttt_length=3)
    draft = get_algorithm(algorithm).from_target_config(model.config, cfg)
    draft.load_target_weights(*target_weights(model))
    g = torch.Generator().manual_seed(3)
    items = []
    for n in (11, 17, 9):
        ids = torch.randint(0, 250, (1, n), generator=g)
        taps, final = capture(model, ids, [0, 2, 4])
        lm = torch.ones(n, dtype=torch.bool)
        lm[:3] = False
        items.append({"input_ids": ids[0], "loss_mask": lm, "taps": taps[0].to(torch.bfloat16), "final_hidden": final[0].to(torch.bfloat16)})
    batch = collate_features(items)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        draft.zero_grad()
        torch.manual_seed(1)  # anchor draws
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = draft.loss(batch.to("cpu", dtype))
        loss.float().backward()
        out[dtype] = (loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    (l32, g32), (l16, g16) = out[torch.float32], out[torch.bfloat16]
    assert torch.equal(l32, l16) and g32.keys() == g16.keys() and g32
    for n in g32:
        assert torch.equal(g32[n], g16[n]), n


@pytest.mark.cuda(reason="page-locked memory")
def test_packed_batches_are_page_locked_once_on_cuda():
    """In a process that trains on a GPU, packing writes the samples straight into page-locked memory: the loader's
    pin_memory() then has nothing left to copy, and the stager's copy is an async DMA."""
    torch.cuda.init()
    items = _items(fp8=True)
    batch = packing(collate_features, 16)(items)
    assert all(t.is_pinned() for t in (batch.taps, batch.final_hidden, batch.taps_scale, batch.input_ids, batch.segment_ids))
    again = batch.pin_memory()
    assert again.taps.data_ptr() == batch.taps.data_ptr()  # no second copy
    assert not pack_features(items, 16, pin=False).taps.is_pinned()
    device = torch.device("cuda")
    staged = list(DeviceStager(iter([(0, 0, batch)]), device, torch.bfloat16))
    torch.cuda.synchronize()
    assert torch.equal(staged[0][2].taps.cpu(), batch.to("cpu", torch.bfloat16).taps)
