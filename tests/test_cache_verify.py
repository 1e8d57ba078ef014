"""A shard that rots after the build: `deepspec data cache --verify` (every shard's checksums, in parallel) names it and
exits 1, training start (a bounded sample of checksums) refuses it, and doing what the verdict says (delete the shard,
rerun the cache command) gives back the very cache that was built. On a tiny random Llama; bytes are flipped on disk."""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from deepspec.config import config_from_dict
from deepspec.data.cache import cli
from deepspec.data.cache import format as fmt
from deepspec.data.cache.verify import check_at_start, sample_plan, verify_cache
from deepspec.data.cache.writer import build_cache
from deepspec.errors import CacheError


@pytest.fixture(scope="module", autouse=True)
def _target_on_cpu():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
        yield


def make_cfg(root: Path, target_dir: Path, **cache):
    return config_from_dict({
        "target": {"name": str(target_dir)},
        "data": {"dir": str(root / "data")},
        "cache": {"dir": str(root / "cache"), "shard_bytes": 300_000, "batch_tokens": 1024, "max_length": 160, "audit": False, **cache},
        "model": {"target_layer_ids": [0, 2]},
    })


@pytest.fixture(scope="module")
def built(tiny_llama_dir, tmp_path_factory, one_torch_thread):
    """(root with data/, cache folder) of a tiny cache of 3 or 4 shards (the default start check samples 4)."""
    from tiny_recipe import write_regenerated

    root = tmp_path_factory.mktemp("verify")
    write_regenerated(root / "data", 24)
    d = build_cache(make_cfg(root, tiny_llama_dir), "train")
    assert 3 <= fmt.load_manifest(d)["num_shards"] <= make_cfg(root, tiny_llama_dir).cache.start_check_shards
    return root, d


def damaged_copy(built, tmp_path: Path, target_dir: Path, sample: int = 5):
    """A copy of the project whose cache has one byte flipped in the middle of `sample`'s record: (cfg, cache, shard)."""
    root, src = built
    shutil.copytree(root / "data", tmp_path / "data")
    d = Path(shutil.copytree(src, tmp_path / "cache" / "train"))
    row = np.load(d / fmt.INDEX)[sample]
    shard = d / fmt.shard_name(int(row["shard"]))
    with open(shard, "r+b") as f:
        f.seek(int(row["offset"]) + int(row["nbytes"]) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x5A]))
    return make_cfg(tmp_path, target_dir), d, shard


def run_cli(target: str, *flags: str) -> int:
    args = argparse.Namespace(config=target, opts=[], split="all", verify="--verify" in flags, audit="--audit" in flags,
                              estimate=False, overwrite=False, nproc=None)
    return cli.main(args)


def test_verify_passes_a_good_cache_and_names_a_damaged_shard(built, tiny_llama_dir, tmp_path, capsys):
    root, src = built
    assert run_cli(str(src), "--verify") == 0
    out, err = capsys.readouterr()
    line = json.loads(out)
    n = fmt.load_manifest(src)["num_shards"]
    assert line["ok"] and line["shards"] == n and line["bytes"] == fmt.load_manifest(src)["bytes"]
    assert err.startswith(f"ok: {n} shard(s), ") and " GiB of " in err and " s." in err

    cfg, d, shard = damaged_copy(built, tmp_path, tiny_llama_dir)
    assert run_cli(str(d), "--verify") == 1
    out, err = capsys.readouterr()
    line = json.loads(out)
    assert not line["ok"] and line["damaged_shards"] == [shard.name] and line["num_corrupt"] == 1
    assert f"1 of {n} shard(s) of {d} fail their checksums: {shard.name}" in err and "delete those shard files and rerun" in err
    # the same through the recipe (CONFIG), as the docs show it
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"target: {{name: {tiny_llama_dir}}}\ndata: {{dir: {tmp_path / 'data'}}}\ncache: {{dir: {tmp_path / 'cache'}}}\n")
    assert run_cli(str(recipe), "--verify") == 1
    assert shard.name in capsys.readouterr().err


def test_parallel_and_serial_verification_agree(built, tiny_llama_dir, tmp_path):
    cfg, d, shard = damaged_copy(built, tmp_path, tiny_llama_dir, sample=11)
    one, many = verify_cache(d, workers=1, progress_bar=False), verify_cache(d, workers=4, progress_bar=False)
    assert one.damaged == many.damaged and list(many.damaged) == [int(shard.name[6:11])]
    assert one.bytes == many.bytes == sum(p.stat().st_size for p in d.glob("shard_*.bin"))


def test_training_start_refuses_a_damaged_shard(built, tiny_llama_dir, tmp_path):
    from deepspec.train.build import open_cache_datasets

    root, src = built
    open_cache_datasets(make_cfg(root, tiny_llama_dir))  # a good cache passes (default budget covers this tiny cache)
    cfg, d, shard = damaged_copy(built, tmp_path, tiny_llama_dir)
    with pytest.raises(CacheError, match=f"{shard.name} is damaged .*--verify.* to list every damaged shard"):
        open_cache_datasets(cfg)
    cfg.cache.start_check_mb = 0  # the check is off
    open_cache_datasets(cfg)


def test_the_start_check_reads_a_bounded_sample(built):
    """At most cache.start_check_shards shards, each given an equal share of cache.start_check_mb (one record at least)."""
    _, d = built
    index = np.load(d / fmt.INDEX)
    n = fmt.load_manifest(d)["num_shards"]
    smallest = int(index["nbytes"].min())
    for budget, shards in ((3 * smallest, 2), (1, 3), (None, 1)):
        plan = sample_plan(index, n, budget, shards, random.Random(0))
        if budget is None:
            assert sum(len(v) for v in plan.values()) == len(index)
            continue
        assert 1 <= len(plan) <= shards and all(plan.values())
        for s, rows in plan.items():
            assert all(index[p]["shard"] == s for p in rows)
            assert len(rows) == 1 or index[rows]["nbytes"].sum() <= budget / shards
    result = check_at_start(d, 1e-6, 2, seed=0)
    assert result.shards == 2 and result.samples == 2  # a byte budget below one record still checks one per shard
    assert check_at_start(d, 0, 2) is None


def test_deleting_the_damaged_shard_and_rerunning_rebuilds_it(built, tiny_llama_dir, tmp_path):
    """What the verdict says to do works: the writer rewrites the missing shard and the cache is the original again."""
    root, src = built
    cfg, d, shard = damaged_copy(built, tmp_path, tiny_llama_dir)
    shard.unlink()
    build_cache(cfg, "train")
    assert verify_cache(d, progress_bar=False).ok
    for p in sorted(src.glob("shard_*.bin")):
        assert (d / p.name).read_bytes() == p.read_bytes()
