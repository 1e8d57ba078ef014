"""The HF capture path converts features to the cache dtype where the target computed them and writes records from a
thread: golden against the host path it replaced (float32 on the host, encoded and checksummed in the capturing
thread) — the same shards, index and counts, byte for byte — and a failure in the writer thread surfaces."""

from __future__ import annotations

import errno
import json
import random
from pathlib import Path

import pytest
import torch

from deepspec.config import config_from_dict
from deepspec.data.cache import format as fmt
from deepspec.data.cache import featurizer, shards, writer
from deepspec.data.cache.plan import plan_split

WORDS = "the cat sat on a mat and then it ran far away to find some food".split()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("capture") / "data"
    d.mkdir()
    rng = random.Random(1)
    with open(d / "regenerated.jsonl", "w") as f:
        for i in range(10):
            conv = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(2, 12)))},
                    {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(5, 40)))}]
            f.write(json.dumps({"id": f"c{i}", "conversations": conv}) + "\n")
    return d


def _cfg(root: Path, data_dir: Path, target_dir: Path, dtype: str, target_dtype: str = "float32"):
    return config_from_dict({
        "target": {"name": str(target_dir), "dtype": target_dtype},
        "data": {"dir": str(data_dir)},
        "cache": {"dir": str(root), "dtype": dtype, "shard_bytes": 30_000, "batch_tokens": 256, "max_length": 128},
    })


def _content(d: Path) -> dict[str, bytes]:
    names = sorted(p.name for p in d.glob("shard_*.bin")) + [fmt.INDEX, fmt.TOKEN_COUNTS, fmt.IDS]
    return {n: (d / n).read_bytes() for n in names}


def _host_path_featurizer(plan, cfg, device, model, session=None):
    """The capture before device-side conversion: float32 features on the host, `encode_record` per sample."""
    from deepspec.targets import load_target_from_config

    model = load_target_from_config(cfg.target, device="cpu").model
    taps, reduction = plan.signature["taps"], plan.signature.get("tap_reduction", "mean")
    return (lambda batch: featurizer.sample_features(model, batch, taps, reduction)), (lambda: None)


@pytest.mark.parametrize("dtype,target_dtype", [("bf16", "float32"), ("fp8", "float32"), ("fp32", "float32"), ("bf16", "bfloat16")])
def test_device_conversion_writes_the_host_paths_bytes(tmp_path, data_dir, tiny_llama_dir, monkeypatch, one_torch_thread,
                                                       dtype, target_dtype):
    monkeypatch.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
    new = writer.build_cache(_cfg(tmp_path / "new", data_dir, tiny_llama_dir, dtype, target_dtype), "train")
    with monkeypatch.context() as m:
        m.setattr(shards, "make_featurizer", _host_path_featurizer)
        old = writer.build_cache(_cfg(tmp_path / "old", data_dir, tiny_llama_dir, dtype, target_dtype), "train")
    a, b = _content(new), _content(old)
    assert len([n for n in a if n.endswith(".bin")]) >= 2  # several shards, several batches each
    assert a.keys() == b.keys() and all(a[n] == b[n] for n in a)


def test_to_storage_matches_encode_record():
    x = torch.randn(5, 3, 16) * torch.logspace(-3, 3, 5)[:, None, None]
    for dtype in ("bf16", "fp8", "fp32"):
        stored, scales = fmt.to_storage(x, dtype)
        assert fmt.encode_stored(range(5), [1] * 5, stored, scales, dtype) == fmt.encode_record(range(5), [1] * 5, x, dtype)


def test_a_failed_write_in_the_writer_thread_stops_the_build_and_keeps_no_partial_shard(tmp_path, data_dir, tiny_llama_dir,
                                                                                         monkeypatch, one_torch_thread):
    from deepspec.diskfull import DiskFullError

    monkeypatch.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
    calls = {"n": 0}
    real = fmt.encode_stored

    def fails_third(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(fmt, "encode_stored", fails_third)
    cfg = _cfg(tmp_path / "c", data_dir, tiny_llama_dir, "bf16")
    with pytest.raises(DiskFullError, match="No room to write the cache shard"):
        writer.build_cache(cfg, "train")
    d = tmp_path / "c" / "train"
    assert not list(d.glob("*.tmp")) and not fmt.is_complete(d)
    plan = plan_split(cfg, "train")
    done = [s for s in range(len(plan.shards)) if shards.shard_done(d, plan, s)]
    assert sorted(p.name for p in d.glob("shard_*.bin")) == [fmt.shard_name(s) for s in done]  # only whole shards kept
    assert sum(b - a for a, b in (plan.shards[s] for s in done)) < 3  # the third record failed
    monkeypatch.setattr(fmt, "encode_stored", real)
    assert fmt.is_complete(writer.build_cache(cfg, "train"))  # the same command resumes
