"""Data stages under faults, in real processes: SIGTERM mid-regeneration and mid-shard of a cache build (the
process sends itself a real SIGTERM at a chosen point, DEEPSPEC_FAULT_SIGTERM), then the same command finishes
the work exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    run_env = dict(os.environ, OMP_NUM_THREADS="1", DEEPSPEC_NO_PROGRESS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    run_env.pop("DEEPSPEC_FAULT_SIGTERM", None)
    run_env.update(env)
    return subprocess.run([sys.executable, "-m", "deepspec.cli", *args], env=run_env, capture_output=True, text=True, timeout=300)


def _recipe(tmp_path: Path, target: Path, *opts: str) -> Path:
    from deepspec.config import load_config, save_config

    cfg = load_config(None, [f"target.name={target}", f"data.dir={tmp_path / 'data'}", "data.regenerate.heldout=false",
                             "data.regenerate.sampling.max_tokens=4", "data.regenerate.engine=hf", "data.regenerate.batch_size=2",
                             *opts])
    return save_config(cfg, tmp_path, "recipe.yaml")


@pytest.mark.slow
def test_sigterm_mid_regeneration_keeps_whole_answers_and_the_rerun_adds_each_missing_one_once(tmp_path, tiny_llama_dir):
    from deepspec.config import load_config
    from deepspec.data.jsonl import read_jsonl, write_jsonl_atomic

    recipe = _recipe(tmp_path, tiny_llama_dir)
    cfg = load_config(recipe)
    ids = [f"p{i}" for i in range(8)]
    write_jsonl_atomic(cfg.conversations_path, [{"id": i, "conversations": [{"role": "user", "content": f"say {i}"}]} for i in ids])
    stopped = _cli("data", "regenerate", str(recipe), DEEPSPEC_FAULT_SIGTERM="regenerate-result:3")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "regenerate: SIGTERM received; 3 of 8 answers are saved in" in stopped.stderr, stopped.stderr[-3000:]
    raw = cfg.regenerated_path.read_bytes()
    assert raw.endswith(b"\n") and len(read_jsonl(cfg.regenerated_path)) == 3  # whole lines only
    rerun = _cli("data", "regenerate", str(recipe))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    got = [r["id"] for r in read_jsonl(cfg.regenerated_path)]
    assert sorted(got) == sorted(ids)  # every id exactly once: duplicates 0, lost 0


@pytest.mark.slow
def test_sigterm_mid_shard_discards_only_the_partial_shard_and_the_rerun_builds_the_same_cache(tmp_path, tiny_llama_dir):
    from deepspec.config import load_config
    from deepspec.data.cache import build_cache
    from deepspec.data.cache import format as fmt
    from deepspec.data.jsonl import write_jsonl_atomic

    words = "the cat sat on a mat and then ran far away from home while it rained all day long".split()
    rows = [{"id": str(i), "conversations": [{"role": "user", "content": " ".join(words[i % 7: i % 7 + 4])},
                                             {"role": "assistant", "content": " ".join(words[i % 5: i % 5 + 12])}]} for i in range(24)]
    opts = ("cache.max_length=64", "cache.shard_bytes=40000", "cache.batch_tokens=64", "cache.dtype=fp32",
            "model.target_layer_ids=[0,2,4]")
    recipe = _recipe(tmp_path, tiny_llama_dir, *opts, f"cache.dir={tmp_path / 'cache'}")
    cfg = load_config(recipe)
    write_jsonl_atomic(cfg.regenerated_path, rows)
    stopped = _cli("data", "cache", str(recipe), "--split", "train", DEEPSPEC_FAULT_SIGTERM="cache-batch:5")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "cache train: SIGTERM received;" in stopped.stderr and "(the shard being written was discarded)" in stopped.stderr
    directory = cfg.cache_train_dir
    assert not list(directory.glob("*.tmp*"))  # bytes of partial artifacts left behind: 0
    assert not fmt.is_complete(directory)
    done = sorted(directory.glob("shard_*.idx.npy"))
    assert 0 < len(done)
    rerun = _cli("data", "cache", str(recipe), "--split", "train")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert fmt.is_complete(directory)
    # an uninterrupted build of the same data is byte for byte the same cache
    clean = load_config(recipe, [f"cache.dir={tmp_path / 'clean'}"])
    build_cache(clean, "train")
    assert np.array_equal(np.load(directory / fmt.INDEX), np.load(clean.cache_train_dir / fmt.INDEX))
    for shard in sorted(clean.cache_train_dir.glob("shard_*.bin")):
        assert (directory / shard.name).read_bytes() == shard.read_bytes()
    assert json.loads((directory / fmt.MANIFEST).read_text())["num_shards"] > len(done)


@pytest.mark.slow
def test_a_cache_worker_killed_mid_shard_stops_the_build_with_one_sentence_and_the_rerun_completes(tmp_path, tiny_llama_dir):
    from deepspec.config import load_config
    from deepspec.data.cache import format as fmt
    from deepspec.data.jsonl import write_jsonl_atomic

    rows = [{"id": str(i), "conversations": [{"role": "user", "content": f"say {i} and {i + 1}"},
                                             {"role": "assistant", "content": f"{i} and {i + 1} and {i + 2} " * 3}]} for i in range(16)]
    recipe = _recipe(tmp_path, tiny_llama_dir, "cache.max_length=64", "cache.shard_bytes=30000", "cache.batch_tokens=64",
                     "cache.dtype=fp32", "model.target_layer_ids=[0,2,4]", "cache.num_workers=2", f"cache.dir={tmp_path / 'cache'}")
    cfg = load_config(recipe)
    write_jsonl_atomic(cfg.regenerated_path, rows)
    stopped = _cli("data", "cache", str(recipe), "--split", "train", DEEPSPEC_FAULT_SIGTERM="cache-batch:3:SIGKILL")
    assert stopped.returncode != 0
    errors = [ln for ln in stopped.stderr.splitlines() if ln.startswith("deepspec: error:")]
    assert len(errors) == 1, stopped.stderr[-3000:]
    last = errors[0]
    assert last.startswith("deepspec: error: Cache worker ") and "was killed by SIGKILL" in last
    assert "every complete shard is kept: rerun the same command" in last and "Traceback" not in stopped.stderr
    assert not fmt.is_complete(cfg.cache_train_dir)
    rerun = _cli("data", "cache", str(recipe), "--split", "train")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert fmt.is_complete(cfg.cache_train_dir) and not list(cfg.cache_train_dir.glob("*.tmp*"))


def _file_size_limit(limit: int):
    import resource
    import signal

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like ENOSPC

    return apply


def _cli_limited(limit: int, *args: str) -> subprocess.CompletedProcess:
    run_env = dict(os.environ, OMP_NUM_THREADS="1", DEEPSPEC_NO_PROGRESS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    run_env.pop("DEEPSPEC_FAULT_SIGTERM", None)
    return subprocess.run([sys.executable, "-m", "deepspec.cli", *args], env=run_env, capture_output=True, text=True, timeout=300,
                          preexec_fn=_file_size_limit(limit))


@pytest.mark.slow
def test_full_disk_mid_regeneration_and_mid_shard_leaves_nothing_partial_and_the_rerun_completes(tmp_path, tiny_llama_dir):
    from deepspec.config import load_config
    from deepspec.data.cache import format as fmt
    from deepspec.data.jsonl import read_jsonl, write_jsonl_atomic

    recipe = _recipe(tmp_path, tiny_llama_dir, "cache.max_length=64", "cache.shard_bytes=40000", "cache.dtype=fp32",
                     "model.target_layer_ids=[0,2,4]", "data.regenerate.sampling.max_tokens=16", f"cache.dir={tmp_path / 'cache'}")
    cfg = load_config(recipe)
    ids = [f"p{i}" for i in range(24)]
    write_jsonl_atomic(cfg.conversations_path, [{"id": i, "conversations": [{"role": "user", "content": f"say {i} " * 3}]} for i in ids])
    full = _cli_limited(1500, "data", "regenerate", str(recipe))
    assert full.returncode == 2, full.stderr[-3000:]
    errors = [ln for ln in full.stderr.splitlines() if ln.startswith("deepspec: error:")]
    assert len(errors) == 1 and f"No room to write rows to {cfg.regenerated_path}: it needs about " in errors[0], full.stderr[-2000:]
    raw = cfg.regenerated_path.read_bytes()
    assert raw.endswith(b"\n") and 0 < len(read_jsonl(cfg.regenerated_path)) < 24  # partial rows kept: 0 bytes
    assert _cli("data", "regenerate", str(recipe)).returncode == 0
    assert sorted(r["id"] for r in read_jsonl(cfg.regenerated_path)) == sorted(ids)

    full = _cli_limited(20_000, "data", "cache", str(recipe), "--split", "train")
    assert full.returncode == 2, full.stderr[-3000:]
    assert f"No room to write the cache shard {cfg.cache_train_dir / fmt.shard_name(0)}: it needs about" in full.stderr
    assert not list(cfg.cache_train_dir.glob("*.tmp*")) and not list(cfg.cache_train_dir.glob("shard_*.bin"))
    assert _cli("data", "cache", str(recipe), "--split", "train").returncode == 0
    assert fmt.is_complete(cfg.cache_train_dir)
