"""Co-located online mode (cache.mode=online): the batch's features stay where the target computed them, in its dtype,
and a draft trained on them sees the offline cache's loss for the same samples."""

from __future__ import annotations

import json
import random

import pytest
import torch

from deepspec.config import config_from_dict
from deepspec.config.model import ModelConfig
from deepspec.data.cache.reader import collate, open_cache
from deepspec.data.cache.writer import build_cache

WORDS = "the cat sat on a mat and then it ran far away to find some food".split()


@pytest.fixture(scope="module")
def fp32_cache(tmp_path_factory, tiny_llama_dir):
    """An exact (fp32) cache captured one sample per forward, as online mode with max_batch_tokens=1 captures."""
    root = tmp_path_factory.mktemp("online")
    rng = random.Random(0)
    (root / "data").mkdir()
    with open(root / "data" / "regenerated.jsonl", "w") as f:
        for i in range(6):
            conv = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 9)))},
                    {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(10, 30)))}]
            f.write(json.dumps({"id": f"c{i}", "conversations": conv}) + "\n")
    cfg = config_from_dict({
        "target": {"name": str(tiny_llama_dir)},
        "data": {"dir": str(root / "data")},
        "cache": {"dir": str(root / "cache"), "dtype": "fp32", "batch_tokens": 1, "max_length": 128},
        "model": {"target_layer_ids": [0, 2, 4]},
    })
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
        d = build_cache(cfg, "train")
    return cfg, open_cache(d, cfg=cfg)


def _target(tiny_llama_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=dtype).eval()


def _online(cfg, tiny_llama_dir):
    from transformers import AutoTokenizer

    from deepspec.data.cache.online import OnlineDataset

    return OnlineDataset.from_config(cfg, AutoTokenizer.from_pretrained(tiny_llama_dir))


def test_online_batch_gives_the_offline_loss(fp32_cache, tiny_llama_dir, one_torch_thread):
    from deepspec.data.cache.online import OnlineFeatures
    from deepspec.drafts import get_algorithm

    cfg, ds = fp32_cache
    model = _target(tiny_llama_dir)
    online = _online(cfg, tiny_llama_dir)
    idx = [0, 2, 3, 5]
    assert [online[i].id for i in idx] == [ds.sample_id(i) for i in idx]
    torch.manual_seed(0)
    draft = get_algorithm("eagle3").from_target_config(model.config, ModelConfig(algorithm="eagle3", target_layer_ids=ds.taps, ttt_length=3))
    draft.eval()
    off = collate([ds[i] for i in idx]).to("cpu", torch.float32)
    loss_off, _ = draft.loss(off)
    # one target forward per sample, as the cache was captured: the same features and the same loss, exactly
    on = OnlineFeatures(model, ds.taps, max_batch_tokens=1)([online[i] for i in idx]).to("cpu", torch.float32)
    for name in ("input_ids", "loss_mask", "attention_mask", "taps", "final_hidden"):
        assert torch.equal(getattr(on, name), getattr(off, name)), name
    assert torch.equal(draft.loss(on)[0], loss_off)
    # the whole micro-batch in one padded forward: the same loss up to fp32 round-off
    on = OnlineFeatures(model, ds.taps)([online[i] for i in idx]).to("cpu", torch.float32)
    assert torch.equal(on.attention_mask, off.attention_mask) and (on.taps[~on.attention_mask] == 0).all()
    torch.testing.assert_close(draft.loss(on)[0], loss_off, rtol=1e-5, atol=1e-6)


def test_online_features_stay_on_the_target_device_in_its_dtype(fp32_cache, tiny_llama_dir, monkeypatch, one_torch_thread):
    """No host conversion: features come back in the target's dtype (bf16 here), on its device, never via .cpu() or
    a float32 widening; their values are the ones the host path rounds from the same forward."""
    from deepspec.data.cache.online import OnlineFeatures
    from deepspec.data.cache.featurizer import sample_features

    cfg, ds = fp32_cache
    model = _target(tiny_llama_dir, torch.bfloat16)
    samples = [_online(cfg, tiny_llama_dir)[i] for i in (1, 4)]
    feats = OnlineFeatures(model, ds.taps)
    host = dict((s.id, f) for s, f in sample_features(model, samples, ds.taps))  # the old path: .float().cpu()

    def no_host_copy(self, *a, **k):
        raise AssertionError("online features were copied to the host")

    monkeypatch.setattr(torch.Tensor, "cpu", no_host_copy)
    batch = feats(samples)
    monkeypatch.undo()
    device = next(model.parameters()).device
    for t in (batch.taps, batch.final_hidden):
        assert t.dtype == torch.bfloat16 and t.device == device
    for b, s in enumerate(samples):
        n = len(s.input_ids)
        want = host[s.id]
        assert torch.equal(batch.taps[b, :n].float(), want[:, :3]) and torch.equal(batch.final_hidden[b, :n].float(), want[:, 3])
    widened = batch.to(device, torch.float32)  # what the trainer does, on its device
    assert widened.taps.dtype == torch.float32


@pytest.mark.cuda(reason="the target's own stream and the stager's")
@pytest.mark.parametrize("pack_tokens, dtype", [(0, torch.float32), (0, torch.bfloat16), (24, torch.float32), (24, torch.bfloat16)])
def test_online_batches_through_the_loader_thread_equal_a_synchronous_forward_on_cuda(fp32_cache, tiny_llama_dir, pack_tokens, dtype):
    """On a GPU the loader thread runs the target on its own stream while the default stream is busy, packs the
    features on the device (train.pack_tokens), and the stager converts them to the training dtype on a third: every
    staged batch must equal the features computed and packed with nothing in flight."""
    from deepspec.data.cache.online import OnlineFeatures
    from deepspec.data.batches import Prefetcher, pack_batch, packing
    from deepspec.train.staging import DeviceStager

    cfg, ds = fp32_cache
    device = torch.device("cuda")
    model = _target(tiny_llama_dir, torch.bfloat16).to(device)
    online = _online(cfg, tiny_llama_dir)
    feats = OnlineFeatures(model, ds.taps)
    plan = [(s, 0, [s % len(online), (s + 3) % len(online), (s + 4) % len(online)]) for s in range(24)]
    want = {}
    for step, _, idx in plan:
        b = feats([online[i] for i in idx])
        torch.cuda.synchronize()
        if pack_tokens:
            b = pack_batch(b, pack_tokens)
            torch.cuda.synchronize()
        b = b.to(device, dtype)
        torch.cuda.synchronize()
        want[step] = (b.taps.clone(), b.final_hidden.clone(), b.input_ids.clone())
    packed_rows = sum(want[s][2].shape[0] < 3 for s in want)
    assert packed_rows == (len(plan) if pack_tokens else 0)  # the packing path did run
    busy = torch.randn(4096, 4096, device=device)
    collate = packing(feats, pack_tokens)
    staged = DeviceStager(Prefetcher(online, lambda items: collate(items, pin=True), iter(plan), depth=2), device, dtype)
    for step, _, batch, _, _ in staged:
        for _ in range(8):  # keep the default stream busy while the next batch is computed, packed and converted
            busy = (busy @ busy).tanh_()
        assert batch.taps.dtype == dtype
        assert torch.equal(batch.taps, want[step][0]) and torch.equal(batch.final_hidden, want[step][1]), step
        assert torch.equal(batch.input_ids.cpu(), want[step][2].cpu()), step


def test_validation_and_the_loader_thread_take_turns_on_the_target(fp32_cache, tiny_llama_dir, one_torch_thread):
    """Tap hooks catch every forward of a tapped layer, whoever runs it: validation on the trainer's thread and the
    loader thread prefetching training batches (train.prefetch_depth = 2) share one target, so they must never run it
    at once, and each must get its own samples' features."""
    import threading
    import time
    from types import SimpleNamespace

    from deepspec.data.cache.online import OnlineFeatures
    from deepspec.data.batches import Prefetcher
    from deepspec.train.dist import DistInfo
    from deepspec.train.validate import run_validation

    cfg, ds = fp32_cache
    model = _target(tiny_llama_dir)
    online = _online(cfg, tiny_llama_dir)
    feats = OnlineFeatures(model, ds.taps)
    n = len(online)
    plan = [(s, 0, [s % n, (s + 2) % n]) for s in range(6)]
    val_chunks = [[0, 1], [2, 3], [4, 5]]
    want = {tuple(idx): feats([online[i] for i in idx]) for idx in [p[2] for p in plan] + val_chunks}  # one at a time

    active, peak, runs = [0], [0], []  # forwards in flight, the most at once, (thread, start, end) of each
    count, local = threading.Lock(), threading.local()

    def enter(module, args):
        with count:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        local.t0 = time.perf_counter()
        time.sleep(0.02)  # a long forward: without turns, the other thread's forward starts inside this one

    def leave(module, args, output):
        with count:
            active[0] -= 1
        runs.append((threading.current_thread().name, local.t0, time.perf_counter()))

    decoder = model.model  # the decoder the tap capture runs (LlamaModel)
    h1 = decoder.register_forward_pre_hook(enter)
    h2 = decoder.register_forward_hook(leave)

    class Held:  # what OnlineData gives validation: samples and the features' collate
        def __init__(self):
            self.collate = feats

        def __len__(self):
            return 6

        def __getitem__(self, i):
            return online[i]

    seen_val = []

    class Recorder(torch.nn.Module):  # stands in for the draft: checks each validation batch's features
        def forward(self, batch):
            seen_val.append((batch.taps.clone(), batch.final_hidden.clone()))
            return torch.zeros(()), {}

    vcfg = SimpleNamespace(train=SimpleNamespace(val_max_samples=6, val_batch_size=2, precision="fp32"))
    info = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"), owns_group=False)
    loader = Prefetcher(online, feats, iter(plan), depth=2)
    try:
        for (step, _, idx), (s_, _, batch) in zip(plan, loader):
            assert s_ == step
            assert torch.equal(batch.taps, want[tuple(idx)].taps) and torch.equal(batch.final_hidden, want[tuple(idx)].final_hidden)
            if step % 2 == 0:  # validate while the loader thread prefetches the next two batches
                seen_val.clear()
                run_validation(Recorder(), Held(), vcfg, info, lambda: torch.autocast("cpu", enabled=False))
                for (taps, final), chunk in zip(seen_val, val_chunks, strict=True):
                    assert torch.equal(taps, want[tuple(chunk)].taps.float()) and torch.equal(final, want[tuple(chunk)].final_hidden.float())
    finally:
        loader.close()
        h1.remove()
        h2.remove()
    assert peak[0] == 1, "validation and the loader thread ran the target at the same time"
    main = threading.current_thread().name
    val_runs = [r for r in runs if r[0] == main]
    load_runs = [r for r in runs if r[0] != main]
    assert len(val_runs) == 9 and len(load_runs) == len(plan)
    # the two did want the target at once: a loader forward ran between the first and last forward of a validation
    assert any(v0[1] < l[1] < v1[1] for l in load_runs for v0, v1 in zip(val_runs, val_runs[1:]))
