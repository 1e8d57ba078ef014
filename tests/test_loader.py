"""The trainer's loader: plan order in threads and worker processes, recycled host buffers, fp8 widened after
the copy, and the process-count policy."""

from __future__ import annotations

import torch

from deepspec.drafts.base import DraftBatch, dequantize
from deepspec.data.batches import collate_features, pack_batch
from deepspec.data.buffers import BufferPool
from deepspec.train.loader import ProcessLoader, build_loader, resolve_processes


class _Samples:
    """A map-style dataset of fixed random samples (bf16 features, like a cache), usable by worker processes."""

    supports_worker_processes = True

    def __init__(self, n: int = 12, taps: int = 3, width: int = 16):
        g = torch.Generator().manual_seed(0)
        self.items = []
        for i in range(n):
            t = 3 + (i * 5) % 11
            self.items.append({"input_ids": torch.randint(0, 50, (t,), generator=g), "loss_mask": torch.rand(t, generator=g) > 0.3,
                               "taps": torch.randn(t, taps, width, generator=g).to(torch.bfloat16),
                               "final_hidden": torch.randn(t, width, generator=g).to(torch.bfloat16)})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def _schedule(n: int):
    return [(s, m, [(3 * s + m) % n, (3 * s + m + 5) % n]) for s in range(4) for m in range(3)]


def _equal(a: DraftBatch, b: DraftBatch) -> bool:
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("input_ids", "loss_mask", "attention_mask", "taps", "final_hidden"))


def test_processes_and_thread_yield_the_plan_in_order():
    ds = _Samples()
    want = [(s, m, collate_features([ds[i] for i in idx])) for s, m, idx in _schedule(len(ds))]
    for processes in (0, 2):
        loader = build_loader(ds, collate_features, iter(_schedule(len(ds))), depth=3, processes=processes, pin=False)
        assert isinstance(loader, ProcessLoader) == (processes > 0)
        got = list(loader)
        loader.close()
        assert [(s, m) for s, m, _ in got] == [(s, m) for s, m, _ in want]
        for (_, _, a), (_, _, b) in zip(got, want):
            assert a.taps.dtype == torch.bfloat16 and _equal(a, b)


def test_thread_is_the_default_and_online_data_never_leaves_the_process():
    class Online(_Samples):
        supports_worker_processes = False

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_processes(None, gpu, 8, _Samples()) == 0
    assert resolve_processes(3, cpu, 1, _Samples()) == 3
    assert resolve_processes(3, gpu, 1, Online()) == 0


def test_pool_recycles_a_buffer_only_when_no_view_is_alive():
    pool = BufferPool(max_buffers=3)
    a = pool.empty((4, 8), torch.bfloat16)
    ptr = a.data_ptr()
    view = a[1:]
    del a
    b = pool.empty((4, 8), torch.bfloat16)
    assert b.data_ptr() != ptr  # a view of the first batch is still held: never overwrite it
    del view
    c = pool.empty((2, 8), torch.bfloat16)
    assert c.data_ptr() == ptr  # idle now: recycled (big enough for a smaller batch)
    d, e = pool.empty((4, 8), torch.float32), pool.empty((4, 8), torch.float32)  # over the cap: plain allocations
    assert len({t.data_ptr() for t in (b, c, d, e)}) == 4


def test_collate_recycles_buffers_without_leaking_previous_contents():
    from deepspec.data.buffers import POOL

    POOL.clear()
    ds = _Samples()
    first = collate_features([ds[2], ds[3]])  # 13 and 7 tokens
    ptr = first.taps.data_ptr()
    del first
    again = collate_features([ds[0], ds[1]])  # 3 and 8 tokens, into the same buffer
    assert again.taps.data_ptr() == ptr
    n = len(ds[0]["input_ids"])
    assert torch.equal(again.taps[0, :n], ds[0]["taps"]) and not again.taps[0, n:].any()  # padding zeroed, not stale


def test_fp8_features_cross_as_fp8_and_widen_with_their_scales():
    """fp8 batches carry per-row scales; DraftBatch.to(device, dtype) widens after the move, packing keeps them."""
    g = torch.Generator().manual_seed(1)
    items = []
    for t in (5, 3):
        x = torch.randn(t, 2, 2 * 8, generator=g)  # 2 taps, each 2 streams of H = 8 (concat)
        f = torch.randn(t, 8, generator=g)
        xs = x.unflatten(-1, (2, 8)).abs().amax(-1) / 448
        fs = f.abs().amax(-1) / 448
        q = (x.unflatten(-1, (2, 8)) / xs[..., None]).flatten(-2).to(torch.float8_e4m3fn)
        items.append({"input_ids": torch.arange(t), "loss_mask": torch.ones(t, dtype=torch.bool), "taps": q, "taps_scale": xs,
                      "final_hidden": (f / fs[:, None]).to(torch.float8_e4m3fn), "final_scale": fs, "_ref": (x, f)})
    batch = collate_features(items)
    assert batch.taps.dtype == torch.float8_e4m3fn and batch.taps_scale.shape == (2, 5, 2, 2)
    wide = batch.to("cpu", torch.float32)
    assert wide.taps_scale is None and wide.taps.dtype == torch.float32
    for b, it in enumerate(items):
        x, f = it["_ref"]
        t = len(x)
        assert torch.equal(wide.taps[b, :t], dequantize(it["taps"], it["taps_scale"], torch.float32))
        assert (wide.taps[b, :t] - x).abs().max() < 0.07 * x.abs().max() and (wide.final_hidden[b, :t] - f).abs().max() < 0.07 * f.abs().max()
        assert not wide.taps[b, t:].any()
    packed = pack_batch(batch, pack_tokens=16).to("cpu", torch.float32)
    assert torch.equal(packed.taps[0, :5], wide.taps[0, :5]) and torch.equal(packed.taps[0, 5:8], wide.taps[1, :3])


def test_bench_loader_measures_the_packed_path(tmp_path, monkeypatch):
    """benchmarks/bench_loader.py --pack-tokens: the cache read through the trainer's packed collate, every token
    counted as in the unpacked read."""
    import importlib.util
    from pathlib import Path

    import deepspec.data.batches as batches

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_loader.py"
    spec = importlib.util.spec_from_file_location("bench_loader", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cache = tmp_path / "cache"
    bench.build_cache(cache, "smollm2-135m", seq_len=48, samples=8)
    packed = []
    real_pack = batches._pack
    monkeypatch.setattr(batches, "_pack", lambda layout, lengths, sources, pin: packed.append(len(layout)) or real_pack(layout, lengths, sources, pin))
    plain = bench.measure(str(cache), 0, 1, 4)
    assert packed == []
    out = bench.measure(str(cache), 0, 1, 4, pack_tokens=96)
    assert packed == [2, 2]  # two micro-batches of 4 x 48 tokens, each into 2 rows of 96
    assert out["tokens"] == plain["tokens"] == 4 * 48  # the first batch of a pass is not timed
