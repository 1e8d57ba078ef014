"""The hidden-state cache on a tiny random Llama: golden alignment against HF, resume after
SIGKILL, multi-worker == single worker, corruption detection, provenance checks, fp8 error,
and the online path producing the same features as the cache."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from deepspec.config import config_from_dict
from deepspec.data.cache import format as fmt
from deepspec.data.cache.plan import estimate, plan_split
from deepspec.data.cache.reader import CacheDataset, collate, open_cache
from deepspec.data.cache.writer import build_cache
from deepspec.data.chat import render_conversation
from deepspec.errors import CacheError

WORDS = "the cat sat on a mat and then it ran far away to find some food while birds sang".split()
REPO = Path(__file__).resolve().parents[1]


def write_conversations(path: Path, n: int, seed: int = 0, short_every: int = 7) -> None:
    """Multi-turn conversations; every `short_every`-th has a 1-word answer (dropped by min_loss_tokens)."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            conv = []
            short = i % short_every == short_every - 1
            for _ in range(1 if short else rng.randint(1, 2)):
                conv.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(2, 12)))})
                k = 1 if short else rng.randint(3, 40)
                conv.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=k))})
            f.write(json.dumps({"id": f"conv-{i}", "conversations": conv, "meta": {}}) + "\n")


def make_cfg(root: Path, target_dir: Path, **cache_opts):
    cache = {"dir": str(root / "cache"), "shard_bytes": 60_000, "batch_tokens": 1024, "max_length": 200, **cache_opts}
    return config_from_dict({
        "target": {"name": str(target_dir)},
        "data": {"dir": str(root / "data")},
        "cache": cache,
    })


@pytest.fixture(scope="module", autouse=True)
def _target_on_cpu():
    """The golden comparisons are against an fp32 HF forward on the CPU; on a GPU machine the cache would run the
    target on the GPU (in bf16 for target.dtype=auto), so these tests pin the cache's target to the CPU."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
        yield


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache-data")
    write_conversations(root / "data" / "regenerated.jsonl", 36)
    write_conversations(root / "data" / "regenerated.heldout.jsonl", 8, seed=1)
    return root


@pytest.fixture(scope="module")
def bf16_cache(data_root, tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    shutil.copytree(data_root / "data", root / "data")
    cfg = make_cfg(root, tiny_llama_dir)
    return cfg, build_cache(cfg, "train")


def cache_content(d: Path) -> dict[str, bytes]:
    """Everything that defines a cache's content (the manifest holds a timestamp, so it is compared apart)."""
    names = sorted(p.name for p in d.glob("shard_*.bin")) + [fmt.INDEX, fmt.TOKEN_COUNTS, fmt.IDS]
    return {n: (d / n).read_bytes() for n in names}


def manifest_sans_time(d: Path) -> dict:
    m = json.loads((d / fmt.MANIFEST).read_text())
    m.pop("created")
    return m


# ---------------------------------------------------------------------------------- golden


@pytest.mark.slow
def test_golden_taps_and_final_hidden_match_hf(data_root, tiny_llama_dir, tmp_path):
    """fp32 storage, one sample per forward: tap k == HF hidden_states[k+1], final == norm(last layer), exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(data_root / "data", tmp_path / "data")
    cfg = make_cfg(tmp_path, tiny_llama_dir, dtype="fp32", batch_tokens=1)
    cfg.model.target_layer_ids = [-1, 1, 3]
    ds = CacheDataset(build_cache(cfg, "train"))
    assert ds.taps == [-1, 1, 3]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    captured = {}
    model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.__setitem__("last", o[0] if isinstance(o, tuple) else o))
    records = [json.loads(l) for l in (tmp_path / "data" / "regenerated.jsonl").read_text().splitlines()]
    ids_by_name = {r["id"]: r for r in records}
    for i in range(len(ds)):
        item = ds[i]
        r = render_conversation(tok, ids_by_name[ds.sample_id(i)]["conversations"], cfg.target.chat_template_kwargs, 200)
        assert item["input_ids"].tolist() == r.input_ids and item["loss_mask"].tolist() == r.loss_mask
        with torch.no_grad():
            out = model(item["input_ids"][None], output_hidden_states=True)
        for j, k in enumerate(ds.taps):
            assert torch.equal(item["taps"][:, j], out.hidden_states[k + 1][0]), f"tap {k} misaligned"
        final = model.model.norm(captured["last"])[0]
        assert torch.equal(item["final_hidden"], final)
        assert torch.equal(model.lm_head(item["final_hidden"]), out.logits[0])  # logits recoverable from the cache
        # and the neighbours are *not* equal: the test can tell an off-by-one layer apart
        assert not torch.equal(item["taps"][:, 1], out.hidden_states[1][0])


@pytest.mark.slow
def test_bf16_batched_cache_matches_hf_rounded(bf16_cache, tiny_llama_dir):
    """Default bf16 storage with padded batches: equal to HF's per-sample states rounded to bf16 (±1 ulp from padding)."""
    from transformers import AutoModelForCausalLM

    cfg, d = bf16_cache
    ds = CacheDataset(d)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for i in range(0, len(ds), 5):
        item = ds[i]
        with torch.no_grad():
            hs = model.model(item["input_ids"][None], output_hidden_states=True).hidden_states
        ref = torch.stack([hs[k + 1][0] for k in ds.taps], 1).to(torch.bfloat16).float()
        assert item["taps"].dtype == torch.bfloat16  # features stay in the cache dtype until the device
        torch.testing.assert_close(item["taps"].float(), ref, rtol=2 ** -7, atol=1e-5)
        torch.testing.assert_close(item["final_hidden"].float(), hs[-1][0].to(torch.bfloat16).float(), rtol=2 ** -7, atol=1e-5)


def test_shard_records_are_written_by_length_and_indexed_in_plan_order(data_root, tiny_llama_dir, tmp_path):
    """Batches group similar lengths (padding is what the target forward wastes); the index stays in plan order."""
    shutil.copytree(data_root / "data", tmp_path / "data")
    cfg = make_cfg(tmp_path, tiny_llama_dir, shard_bytes=10**8)  # one shard: every sample in one layout
    d = build_cache(cfg, "train")
    index = np.load(d / fmt.INDEX)
    ids = json.loads((d / fmt.IDS).read_text())
    records = [json.loads(l)["id"] for l in (tmp_path / "data" / "regenerated.jsonl").read_text().splitlines()]
    kept = set(ids)
    assert ids == [r for r in records if r in kept]  # plan order = file order, dropped samples aside
    assert (index["shard"] == 0).all()
    assert not (np.diff(index["length"]) >= 0).all()  # the plan order is not sorted, so the next line can fail
    assert (np.diff(index[np.argsort(index["offset"])]["length"]) >= 0).all()
    ds = CacheDataset(d)
    assert [len(ds[i]["input_ids"]) for i in range(len(ds))] == index["length"].tolist()


def test_counts_drops_truncation_and_token_counts(bf16_cache):
    cfg, d = bf16_cache
    m = fmt.load_manifest(d)
    c = m["counts"]
    assert c["input"] == 36 and c["dropped_short"] == 36 // 7 and c["samples"] == 36 - 36 // 7
    ds = CacheDataset(d)
    items = [ds[i] for i in range(len(ds))]
    assert c["truncated"] == sum(int(r["truncated"]) for r in ds.index) and c["truncated"] > 0
    assert all(len(x["input_ids"]) <= 200 for x in items)
    assert all(int(x["loss_mask"].sum()) >= cfg.cache.min_loss_tokens for x in items)
    assert c["tokens"] == sum(len(x["input_ids"]) for x in items)
    expected = torch.zeros(m["vocab_size"], dtype=torch.long)
    for x in items:
        expected += torch.bincount(x["input_ids"][x["loss_mask"]], minlength=m["vocab_size"])
    assert torch.equal(ds.token_counts(), expected)
    for key in ("target", "taps", "hidden_size", "template_hash", "data_hash", "deepspec_version", "max_length", "dtype"):
        assert key in m, key
    assert m["num_shards"] > 3  # small shard_bytes: several shards, so resume/workers are meaningful
    assert (d / "config.yaml").is_file()


def test_estimate_is_exact_and_writes_nothing(bf16_cache, tmp_path, capsys):
    from deepspec.cli import main

    cfg, d = bf16_cache
    est = estimate(plan_split(cfg, "train"))
    assert est["bytes"] == sum(p.stat().st_size for p in d.glob("shard_*.bin"))
    (tmp_path / "cfg.yaml").write_text(json.dumps({
        "target": {"name": cfg.target.name}, "data": {"dir": cfg.data.dir},
        "cache": {"dir": str(tmp_path / "cache"), "shard_bytes": 60_000, "max_length": 200},
    }))
    assert main(["data", "cache", str(tmp_path / "cfg.yaml"), "--estimate"]) == 0
    lines = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    assert [x["split"] for x in lines] == ["train", "heldout"]
    assert lines[0]["bytes"] == est["bytes"] and lines[0]["bytes_per_token"] > 0
    assert not (tmp_path / "cache").exists()


def test_complete_cache_is_skipped_and_changed_settings_refused(bf16_cache):
    cfg, d = bf16_cache
    before = (d / fmt.MANIFEST).stat().st_mtime_ns
    build_cache(cfg, "train")
    assert (d / fmt.MANIFEST).stat().st_mtime_ns == before
    cfg.cache.max_length = 150
    try:
        with pytest.raises(CacheError, match="max_length"):
            build_cache(cfg, "train")
    finally:
        cfg.cache.max_length = 200


# ---------------------------------------------------------------------------------- resume, workers


@pytest.mark.slow
def test_sigkill_mid_build_then_resume_is_byte_identical(data_root, tiny_llama_dir, bf16_cache, tmp_path):
    _, ref_dir = bf16_cache
    shutil.copytree(data_root / "data", tmp_path / "data")
    cfg = make_cfg(tmp_path, tiny_llama_dir)
    (tmp_path / "cfg.yaml").write_text(json.dumps({
        "target": {"name": str(tiny_llama_dir)}, "data": {"dir": str(tmp_path / "data")},
        "cache": {"dir": str(tmp_path / "cache"), "shard_bytes": 60_000, "batch_tokens": 1024, "max_length": 200},
    }))
    d = tmp_path / "cache" / "train"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "deepspec.cli", "data", "cache", str(tmp_path / "cfg.yaml"), "--split", "train"],
                            env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(d.glob("shard_*.idx.npy"))) < 2:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = {p.name: p.stat().st_mtime_ns for p in d.glob("shard_*.idx.npy")}
    assert len(done_before) >= 2 and not fmt.is_complete(d), "the build was not interrupted mid-way"
    assert len(done_before) < json.loads((ref_dir / fmt.MANIFEST).read_text())["num_shards"]
    build_cache(cfg, "train")  # rerun the same build: resumes
    assert fmt.is_complete(d)
    for name, mtime in done_before.items():  # finished shards were not recomputed
        assert (d / name).stat().st_mtime_ns == mtime
    assert cache_content(d) == cache_content(ref_dir)
    assert not list(d.glob("*.tmp"))


@pytest.mark.slow
def test_two_workers_equal_one_worker(data_root, tiny_llama_dir, bf16_cache, tmp_path):
    _, ref_dir = bf16_cache
    shutil.copytree(data_root / "data", tmp_path / "data")
    cfg = make_cfg(tmp_path, tiny_llama_dir)
    d = build_cache(cfg, "train", nproc=2)  # two spawned processes in a gloo group
    assert fmt.is_complete(d)
    assert cache_content(d) == cache_content(ref_dir)
    a, b = manifest_sans_time(d), manifest_sans_time(ref_dir)
    a.pop("data_path"), b.pop("data_path")
    assert a == b


def test_cache_worker_barrier_is_gloo_on_a_gpu_machine(monkeypatch):
    """`--nproc N` spawns CPU workers; their barrier-only group was NCCL whenever a GPU was visible, and two ranks on
    one GPU failed ("Duplicate GPU detected", seen on an H100). The group never carries tensors: gloo everywhere."""
    import torch.distributed as dist

    from deepspec.data.cache import ranks

    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend=None, **kw: seen.setdefault("backend", backend))
    monkeypatch.setattr(dist, "barrier", lambda *a, **kw: seen.setdefault("barrier", True))
    ranks.barrier()
    assert seen == {"backend": "gloo", "barrier": True}


@pytest.mark.slow
def test_overwrite_rebuilds(bf16_cache, tmp_path, data_root, tiny_llama_dir):
    shutil.copytree(data_root / "data", tmp_path / "data")
    cfg = make_cfg(tmp_path, tiny_llama_dir, dtype="fp8")
    d = build_cache(cfg, "heldout")
    assert fmt.load_manifest(d)["split"] == "heldout"
    (d / "junk").write_text("x")
    build_cache(cfg, "heldout", overwrite=True)
    assert not (d / "junk").exists() and fmt.is_complete(d)


# ---------------------------------------------------------------------------------- reader errors


def test_truncated_shard_is_reported_with_sample_id(bf16_cache, tmp_path):
    _, src = bf16_cache
    d = shutil.copytree(src, tmp_path / "c")
    ds = CacheDataset(d)
    shard = d / fmt.shard_name(1)
    rows = np.nonzero(ds.index["shard"] == 1)[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    assert not fmt.is_complete(d)
    ds = CacheDataset(d)
    ds[int(np.nonzero(ds.index["shard"] == 0)[0][0])]  # other shards still read
    with pytest.raises(CacheError, match=f"Sample '{ds.sample_id(int(rows[-1]))}'.*truncated"):
        ds[int(rows[-1])]


def test_corrupt_shard_fails_checksum_with_sample_id(bf16_cache, tmp_path):
    _, src = bf16_cache
    d = shutil.copytree(src, tmp_path / "c")
    ds = CacheDataset(d)
    row = ds.index[2]
    with open(d / fmt.shard_name(int(row["shard"])), "r+b") as f:
        f.seek(int(row["offset"]) + int(row["nbytes"]) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    ds = CacheDataset(d, verify=True)
    with pytest.raises(CacheError, match=f"Sample '{ds.sample_id(2)}'.*checksum"):
        ds[2]
    # training reads skip checksums (they cost as much as the copy); `deepspec data cache --verify` finds it
    fast = CacheDataset(d)
    fast[2]
    assert fast.verify_all(progress_bar=False) == [fast.sample_id(2)]
    assert CacheDataset(src).verify_all(progress_bar=False) == []


def test_verify_cli_reports_corrupt_sample(bf16_cache, tmp_path, capsys, monkeypatch):
    """`deepspec data cache CONFIG --verify`: one JSON line per split, exit status 1 naming the corrupt sample."""
    from deepspec.data.cache import cli

    cfg, src = bf16_cache
    assert cli.verify(cfg, ["train"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    d = shutil.copytree(src, tmp_path / "c")
    row = CacheDataset(d).index[1]
    with open(d / fmt.shard_name(int(row["shard"])), "r+b") as f:
        f.seek(int(row["offset"]) + int(row["nbytes"]) - 3)
        f.write(b"\xff\x00\xff")
    import deepspec.data.cache.plan as plan

    monkeypatch.setattr(plan, "split_paths", lambda c, split: (None, d))  # the copy is the split's cache
    assert cli.verify(cfg, ["train"]) == 1
    line = json.loads(capsys.readouterr().out)
    assert line["num_corrupt"] == 1 and line["corrupt"] == [CacheDataset(d).sample_id(1)]


def test_items_are_zero_copy_views_in_the_cache_dtype(bf16_cache):
    """A read copies no features: taps / final_hidden view the mapped shard in bf16, and collation keeps bf16
    until DraftBatch.to widens on the device (exactly: bf16 -> fp32 is lossless)."""
    from deepspec.data.cache.reader import widen
    from deepspec.data.batches import collate_features

    _, d = bf16_cache
    ds = CacheDataset(d)
    item = ds[3]
    assert item["taps"].dtype == item["final_hidden"].dtype == torch.bfloat16
    shard = ds._maps[int(ds.index[3]["shard"])][1]
    base = np.frombuffer(shard, dtype=np.uint8).ctypes.data
    ptr = item["taps"].untyped_storage().data_ptr()
    assert base <= ptr < base + len(shard)  # the storage is the mapping itself
    batch = collate_features([ds[3], ds[4]])
    assert batch.taps.dtype == torch.bfloat16
    # a sample outlives its shard's eviction from the LRU of open maps (the map stays until its views are freed)
    small = CacheDataset(d, max_open_files=1)
    kept = small[3]
    before = kept["taps"].float().sum()
    for j in range(len(small)):
        small[j]
    assert len(small._maps) == 1 and torch.equal(kept["taps"].float().sum(), before)
    wide = batch.to("cpu", torch.float32)
    assert wide.taps.dtype == torch.float32
    n = len(item["input_ids"])
    assert torch.equal(wide.taps[0, :n], widen(item)["taps"]) and torch.equal(wide.final_hidden[0, :n], item["final_hidden"].float())


def test_incomplete_cache_is_refused(tmp_path):
    with pytest.raises(CacheError, match="not a complete cache"):
        CacheDataset(tmp_path)


def test_manifest_mismatch_names_the_fields(bf16_cache):
    cfg, d = bf16_cache
    m = fmt.load_manifest(d)
    fmt.check_manifest(m, {"taps": m["taps"], "hidden_size": 64, "target": cfg.target.name, "dtype": "bf16",
                           "template_hash": m["template_hash"]})
    with pytest.raises(CacheError, match=r"taps: cache has \[1, 2\], run wants \[1, 3\]") as e:
        fmt.check_manifest(m, {"taps": [1, 3], "hidden_size": 64})
    assert "hidden_size" not in str(e.value)
    with pytest.raises(CacheError) as e:
        fmt.check_manifest(m, {"hidden_size": 128, "dtype": "fp8", "template_hash": "0" * 16, "target": "other"})
    for field in ("hidden_size", "dtype", "template_hash", "target"):
        assert field in str(e.value)
    assert len(open_cache(d, cfg)) == m["counts"]["samples"]  # the config it was built with passes
    other = config_from_dict({"target": {"name": cfg.target.name}, "model": {"target_layer_ids": [0, 2]}})
    with pytest.raises(CacheError, match=r"taps: cache has \[1, 2\], run wants \[0, 2\]"):
        open_cache(d, other)
    other = config_from_dict({"target": {"name": cfg.target.name}, "cache": {"dtype": "fp8"}})
    with pytest.raises(CacheError, match="dtype"):
        open_cache(d, other)
    other = config_from_dict({"target": {"name": cfg.target.name, "chat_template_kwargs": {"enable_thinking": True}}})
    with pytest.raises(CacheError, match="chat_template_kwargs"):
        open_cache(d, other)


# ---------------------------------------------------------------------------------- dtypes


def test_fp8_reconstruction_error_bounded_and_compact():
    torch.manual_seed(0)
    x = torch.randn(64, 4, 576) * torch.logspace(-2, 2, 64)[:, None, None]  # very different token scales
    x[3, 1, 7] = 500.0  # an outlier only affects its own (token, layer) row
    out = {}
    for dtype in ("bf16", "fp8"):
        buf = fmt.encode_record(np.zeros(64), np.zeros(64), x, dtype)
        _, _, y = fmt.decode_record(buf, 64, 4, 576, dtype)
        out[dtype] = ((y - x).norm(dim=-1) / x.norm(dim=-1))  # per (token, layer) relative error
    assert out["bf16"].max() < 4e-3
    assert out["fp8"].max() < 0.05 and out["fp8"].mean() < 0.035
    assert out["fp8"].mean() > out["bf16"].mean()  # fp8 is really quantized
    # the embedded target's shape: 3 taps + final, H = 576
    bf16, fp8 = (fmt.record_nbytes(2048, 4, 576, d) / 2048 for d in ("bf16", "fp8"))
    assert fp8 <= 0.55 * bf16


@pytest.mark.slow
def test_fp8_cache_close_to_bf16_cache(bf16_cache, data_root, tiny_llama_dir, tmp_path):
    _, bf_dir = bf16_cache
    shutil.copytree(data_root / "data", tmp_path / "data")
    d = build_cache(make_cfg(tmp_path, tiny_llama_dir, dtype="fp8"), "train")
    a, b = CacheDataset(bf_dir), CacheDataset(d)
    assert sum(p.stat().st_size for p in d.glob("shard_*.bin")) < 0.55 * sum(p.stat().st_size for p in bf_dir.glob("shard_*.bin"))
    from deepspec.data.cache.reader import widen

    assert b[0]["taps"].dtype == torch.float8_e4m3fn and b[0]["taps_scale"].shape == (*b[0]["taps"].shape[:2], 1)
    for i in range(0, len(a), 4):
        x, y = widen(a[i]), widen(b[i])
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        rel = (y["taps"] - x["taps"]).norm() / x["taps"].norm()
        assert rel < 0.05
        assert (y["final_hidden"] - x["final_hidden"]).norm() / x["final_hidden"].norm() < 0.05


# ---------------------------------------------------------------------------------- batches


def test_collate_and_dataloader_workers(bf16_cache):
    from torch.utils.data import DataLoader

    from deepspec.data.cache.sampler import ResumableBatchSampler

    _, d = bf16_cache
    ds = CacheDataset(d, max_open_files=2)
    sampler = ResumableBatchSampler(ds.lengths, 4, seed=3, bucket_batches=2)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=collate, num_workers=2)
    batches = list(loader)
    assert len(batches) == len(ds) // 4
    first = batches[0]
    idx = ResumableBatchSampler(ds.lengths, 4, seed=3, bucket_batches=2).global_batch(0, 0)
    lengths = [int(ds.lengths[i]) for i in idx]
    assert first.input_ids.shape[1] == max(lengths)
    assert first.attention_mask.sum(1).tolist() == lengths
    assert not (first.loss_mask & ~first.attention_mask).any()
    for b, i in enumerate(idx):
        t = lengths[b]
        assert torch.equal(first.taps[b, :t], ds[i]["taps"]) and (first.taps[b, t:] == 0).all()
    assert len(ds._maps) <= 2


def test_online_features_equal_cache(bf16_cache, tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepspec.data.cache.online import OnlineDataset, OnlineFeatures

    cfg, d = bf16_cache
    ds = CacheDataset(d)
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    online = OnlineDataset.from_config(cfg, tok)
    assert len(online) == len(ds) and [s.id for s in online.samples] == [ds.sample_id(i) for i in range(len(ds))]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    feats = OnlineFeatures(model, ds.taps)
    idx = [0, 5, 9, 12]
    on = feats([online[i] for i in idx])
    off = collate([ds[i] for i in idx]).to("cpu", torch.float32)  # widened as the trainer widens on its device
    assert torch.equal(on.input_ids, off.input_ids) and torch.equal(on.loss_mask, off.loss_mask)
    assert torch.equal(on.attention_mask, off.attention_mask)
    m = on.attention_mask
    torch.testing.assert_close(on.taps[m], off.taps[m], rtol=2 ** -7, atol=1e-4)  # cache = bf16 rounding
    torch.testing.assert_close(on.final_hidden[m], off.final_hidden[m], rtol=2 ** -7, atol=1e-4)
    assert not torch.equal(on.taps[m], off.taps[m])  # online really is the unrounded fp32


def test_input_changed_mid_build_is_refused(data_root, tiny_llama_dir, tmp_path):
    """Plans keep only offsets and lengths; a file edited under a running build must not be mixed in."""
    from deepspec.data.cache.plan import load_plan_inputs, make_plan, materialize
    from deepspec.errors import DataError

    shutil.copytree(data_root / "data", tmp_path / "data")
    cfg = make_cfg(tmp_path, tiny_llama_dir)
    tok, tconf = load_plan_inputs(cfg)
    plan = make_plan(cfg, "train", tok, tconf)
    assert all(s.input_ids is None for s in plan.samples)  # nothing heavy held by the plan
    first = materialize(plan, plan.samples[:2], tok)
    assert [len(s.input_ids) for s in first] == [s.length for s in plan.samples[:2]]
    path = tmp_path / "data" / "regenerated.jsonl"
    path.write_text(path.read_text().replace("conv-0", "conv-X", 1))
    with pytest.raises(DataError, match="changed while the cache was being built"):
        materialize(plan, plan.samples[:1], tok)


# ---------------------------------------------------------------------------------- multi-stream (mhc) targets


@pytest.fixture(scope="module")
def mhc_dir(tmp_path_factory):
    from deepspec.targets.tiny_mhc import save_tiny_mhc

    return save_tiny_mhc(tmp_path_factory.mktemp("tiny-mhc"))


def _mhc_cache(data_root, mhc_dir, root: Path, reduction: str, dtype: str = "fp32"):
    shutil.copytree(data_root / "data", root / "data", dirs_exist_ok=True)
    cfg = make_cfg(root, mhc_dir, dtype=dtype)
    cfg.model.tap_reduction = reduction
    cfg.model.target_layer_ids = [-1, 1, 3]
    return cfg, build_cache(cfg, "train")


@pytest.mark.slow
def test_mhc_cache_stores_reduced_taps_and_records_them(data_root, mhc_dir, tmp_path):
    """Golden: cached taps (mean: H wide, concat: S*H wide) equal the reduced streams of the target's forward;
    the manifest records hc_mult and tap_reduction; concat costs S times the tap bytes of mean."""
    from deepspec.targets import load_target

    target = load_target(str(mhc_dir), device="cpu", dtype="float32")
    S, H = target.config.hc_mult, target.config.hidden_size
    sizes = {}
    for reduction in ("mean", "concat"):
        cfg, d = _mhc_cache(data_root, mhc_dir, tmp_path / reduction, reduction)
        ds = open_cache(d, cfg=cfg)
        m = ds.manifest
        assert (m["hc_mult"], m["tap_reduction"]) == (S, reduction)
        item = ds[0]
        with torch.no_grad():
            ref = target.model.model(input_ids=item["input_ids"][None], output_hidden_states=True)
        want = torch.stack([ref.hidden_states[k + 1][0] for k in m["taps"]], 1)  # [T, n, S, H]
        want = want.mean(2) if reduction == "mean" else want.flatten(2)
        assert item["taps"].shape == (len(item["input_ids"]), 3, H if reduction == "mean" else S * H)
        assert torch.allclose(item["taps"], want, atol=1e-5)
        assert torch.allclose(item["final_hidden"], ref.last_hidden_state[0], atol=1e-5)
        batch = collate([ds[0], ds[1]])
        assert batch.taps.shape[-1] == item["taps"].shape[-1] and batch.final_hidden.shape[-1] == H
        # online mode computes the same reduced features as the cache holds
        from deepspec.data.cache.online import OnlineFeatures
        from deepspec.data.cache.sample import Sample

        sample = Sample("s0", item["input_ids"].numpy().astype(np.int32), item["loss_mask"].numpy().astype(np.uint8), False)
        (online,) = OnlineFeatures(target.model, m["taps"], tap_reduction=reduction).features([sample])
        assert torch.allclose(online["taps"], item["taps"], atol=1e-5) and online["final_hidden"].shape == (len(sample.input_ids), H)
        sizes[reduction] = m["bytes"] / m["counts"]["tokens"]
    # fp32 record: ids 4 + mask 1 + 4 * (n_taps * rows + 1) * H per token (+ alignment)
    assert sizes["concat"] > 3 * sizes["mean"]


def test_mhc_cache_with_other_tap_reduction_is_refused(data_root, mhc_dir, tmp_path):
    cfg, d = _mhc_cache(data_root, mhc_dir, tmp_path, "mean")
    cfg.model.tap_reduction = "concat"
    with pytest.raises(CacheError, match=r"tap_reduction: cache has 'mean', run wants 'concat' \(model.tap_reduction\)"):
        open_cache(d, cfg=cfg)


def test_manifest_without_stream_fields_reads_as_single_stream():
    fmt.check_manifest({"taps": [1]}, {"taps": [1], "hc_mult": 1, "tap_reduction": "mean"})
    with pytest.raises(CacheError, match="hc_mult"):
        fmt.check_manifest({"taps": [1]}, {"hc_mult": 4})


def test_vllm_capture_refuses_concat_of_a_multi_stream_target():
    """vLLM hands back one H-wide state per layer: a concat cache of a multi-stream target is refused before vLLM starts."""
    from types import SimpleNamespace

    from deepspec.data.cache.featurizer import make_featurizer

    plan = SimpleNamespace(signature={"taps": [1, 2], "capture_backend": "vllm", "hc_mult": 4, "tap_reduction": "concat"})
    with pytest.raises(CacheError, match="capture_backend=hf"):
        make_featurizer(plan, None, None, None)
