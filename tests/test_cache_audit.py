"""The capture audit on a tiny random Llama: a good cache passes with its report saved by the build itself; a capture
with a zeroed tap, a tap shifted by one layer (layer L+1's output stored as tap L) and a garbage tap are each refused
with one sentence naming the tap and the record, by `deepspec data cache --audit`, by the build's own audit and at
training start. The bad captures are written as a broken capture would write them: valid records with correct
checksums whose features are wrong."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from deepspec.config import config_from_dict
from deepspec.data.cache import format as fmt
from deepspec.data.cache.audit import REPORT, audit_after_build, audit_cache
from deepspec.data.cache.reader import CacheDataset
from deepspec.data.cache.writer import build_cache
from deepspec.errors import CacheError

TAPS = [0, 1, 3]


def make_cfg(root: Path, target_dir: Path, **cache):
    return config_from_dict({
        "target": {"name": str(target_dir)},
        "data": {"dir": str(root / "data")},
        "cache": {"dir": str(root / "cache"), "shard_bytes": 40_000, "batch_tokens": 1024, "max_length": 160, **cache},
        "model": {"target_layer_ids": TAPS},
    })


@pytest.fixture(scope="module", autouse=True)
def _target_on_cpu():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
        yield


@pytest.fixture(scope="module")
def good(tiny_llama_dir, tmp_path_factory, one_torch_thread):
    """(cfg, cache folder) of a bf16 cache built by the real writer, which audits it as its last step."""
    from tiny_recipe import write_regenerated

    root = tmp_path_factory.mktemp("audit")
    write_regenerated(root / "data", 20)
    cfg = make_cfg(root, tiny_llama_dir)
    return cfg, build_cache(cfg, "train")


def hf_hidden_states(target_dir: Path, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None], output_hidden_states=True).hidden_states


def tampered(src: Path, dst: Path, change) -> Path:
    """A copy of the cache whose every record's features went through `change(i, input_ids, features [T, L, H])`,
    re-encoded with fresh checksums (so only the features are wrong, as a broken capture writes them)."""
    d = Path(shutil.copytree(src, dst))
    (d / REPORT).unlink()
    ds = CacheDataset(d)
    index = ds.index.copy()
    for i, row in enumerate(index):
        path = d / fmt.shard_name(int(row["shard"]))
        off, nbytes = int(row["offset"]), int(row["nbytes"])
        with open(path, "r+b") as f:
            f.seek(off)
            ids, mask, feats = fmt.decode_record(f.read(nbytes), int(row["length"]), len(TAPS) + 1, ds.hidden_size, ds.dtype)
            data = fmt.encode_record(ids, mask, change(i, ids, feats.clone()), ds.dtype)
            assert len(data) == nbytes
            f.seek(off)
            f.write(data)
        index[i]["crc32"] = zlib.crc32(data)
    fmt.write_npy_atomic(d / fmt.INDEX, index)
    return d


def zeroed(target_dir):
    def change(i, ids, feats):
        feats[:, 1] = 0  # tap 1: what a hybrid target's linear-attention layer gave a hook that read the wrong output
        return feats
    return change


def shifted(target_dir):
    def change(i, ids, feats):
        feats[:, 0] = hf_hidden_states(target_dir, ids)[2][0]  # layer 1's output stored as tap 0: the off-by-one
        return feats
    return change


def garbage(target_dir):
    def change(i, ids, feats):
        g = torch.Generator().manual_seed(i)
        noise = torch.randn(feats[:, 2].shape, generator=g)
        feats[:, 2] = noise * feats[:, 2].norm(dim=-1, keepdim=True) / noise.norm(dim=-1, keepdim=True)  # same norms, no signal
        return feats
    return change


def test_a_good_cache_passes_and_the_build_saves_its_report(good):
    cfg, d = good
    report = json.loads((d / REPORT).read_text())
    assert report["ok"] and not report["failures"] and report["verdict"].startswith("capture audit ok")
    assert report["manifest_created"] == fmt.load_manifest(d)["created"]
    assert len(report["records"]) == min(cfg.cache.audit_records, len(CacheDataset(d))) and len(report["recomputed"]) == 2
    for row in report["taps"]:
        assert row["nonfinite"] == row["zero_rows"] == row["constant_rows"] == 0 and row["rows"] > 0
        assert row["rel_error"] < 0.01  # bf16 storage of an fp32 forward: ~0.2% per token
        if row["tap"] != "final":
            assert row["best_match"] == row["tap"]
    from deepspec.train.build import open_cache_datasets

    train, _ = open_cache_datasets(cfg)  # the training-start checks pass
    assert len(train) == len(CacheDataset(d))


@pytest.mark.parametrize("make, tap, finding", [
    (zeroed, 1, "token rows all zero"),
    (shifted, 0, "matches decoder layer 1 .* better than its own layer"),
    (garbage, 3, "differs from the target's recomputed hidden state by"),
], ids=["zeroed", "shifted", "garbage"])
def test_a_bad_capture_is_refused_naming_the_tap_and_the_record(good, tiny_llama_dir, tmp_path, capsys, make, tap, finding):
    from deepspec.data.cache import cli
    from deepspec.train.build import check_before_training

    cfg, src = good
    d = tampered(src, tmp_path / "bad", make(tiny_llama_dir))
    first = CacheDataset(d).sample_id(0)
    sentence = f"tap {tap} .*of sample '{first}' .*{finding}"
    # `deepspec data cache <folder> --audit`: exit status 1, the sentence on stderr, the report saved beside the manifest
    args = argparse.Namespace(config=str(d), verify=False, audit=True, opts=[], split="all")
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "fails its capture audit" in err and re.search(sentence, err), err
    report = json.loads((d / REPORT).read_text())
    assert not report["ok"] and report["manifest_created"] == fmt.load_manifest(d)["created"]
    # training refuses it at start, with the same sentence
    with pytest.raises(CacheError, match=sentence):
        check_before_training(cfg, [d])
    # the audit the writer runs after a build stops the build the same way
    with pytest.raises(CacheError, match=sentence):
        audit_after_build(cfg, d)


def test_an_audit_report_of_an_older_build_is_not_trusted(good, tmp_path, logs):
    """A report whose manifest timestamp is not the cache's (the cache was rebuilt since) is ignored with a warning."""
    from deepspec.train.build import check_before_training

    cfg, src = good
    d = Path(shutil.copytree(src, tmp_path / "c"))
    report = json.loads((d / REPORT).read_text())
    report.update(ok=False, verdict="stale", manifest_created="1999-01-01T00:00:00Z")
    (d / REPORT).write_text(json.dumps(report))
    check_before_training(cfg, [d])
    assert "has no capture audit for this build" in logs.text


def test_the_audit_reads_few_records(good):
    """Its cost is bounded by cache.audit_records and cache.audit_recompute, not by the cache's size."""
    cfg, d = good
    report = audit_cache(d, records=5, recompute=0, save=False)
    assert len(report["records"]) == 5 and report["recomputed"] == [] and report["ok"]
    assert all(row["rows"] == sum(CacheDataset(d).lengths[i] for i in np.linspace(0, len(CacheDataset(d)) - 1, 5).astype(int))
               for row in report["taps"])
