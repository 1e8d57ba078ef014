"""The cache stage under torchrun (scripts/data/cache.sh): 2 gloo CPU workers, each capturing its share of the
shards, write a cache byte for byte equal to one worker's in-process build."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORDS = "one two three four five six seven eight nine ten red green blue cat dog bird".split()


def _write(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            conv = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(2, 10)))},
                    {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(4, 40)))}]
            f.write(json.dumps({"id": f"c{i}", "conversations": conv}) + "\n")


def _content(d: Path) -> dict[str, bytes]:
    from deepspec.data.cache import format as fmt

    names = sorted(p.name for p in d.glob("shard_*.bin")) + [fmt.INDEX, fmt.TOKEN_COUNTS, fmt.IDS]
    return {n: (d / n).read_bytes() for n in names}


@pytest.mark.slow
def test_torchrun_workers_write_the_single_worker_cache(tmp_path, tiny_llama_dir, monkeypatch):
    from deepspec.config import load_config
    from deepspec.data.cache import format as fmt
    from deepspec.data.cache.writer import build_cache

    _write(tmp_path / "data" / "regenerated.jsonl", 30, 0)
    _write(tmp_path / "data" / "regenerated.heldout.jsonl", 6, 1)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"target: {{name: {tiny_llama_dir}}}\ndata: {{dir: {tmp_path / 'data'}}}\n"
        "cache: {shard_bytes: 60000, batch_tokens: 1024, max_length: 160}\nmodel: {target_layer_ids: [0, 2, 4]}\n"
    )
    monkeypatch.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")  # the reference: one worker, in this process, on the CPU
    one = build_cache(load_config(recipe, [f"cache.dir={tmp_path / 'one'}"]), "train", nproc=1)
    env = dict(os.environ, OMP_NUM_THREADS="1", DEEPSPEC_NO_PROGRESS="1", PYTHONPATH=str(REPO), PYTHON=sys.executable,
               CUDA_VISIBLE_DEVICES="")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DEEPSPEC_CACHE_DEVICE"):
        env.pop(k, None)
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/data/cache.sh"), str(recipe), "--nproc", "2", "--opts", f"cache.dir={tmp_path / 'two'}"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = load_config(recipe, [f"cache.dir={tmp_path / 'two'}"])
    two = Path(cfg.cache_train_dir)
    assert fmt.is_complete(two) and fmt.is_complete(Path(cfg.cache_heldout_dir))  # both splits, like `deepspec data cache`
    m = json.loads((two / fmt.MANIFEST).read_text())
    assert m["num_shards"] >= 3  # several shards: each rank really captured its own share
    assert _content(two) == _content(one)
    a, b = (json.loads((d / fmt.MANIFEST).read_text()) for d in (one, two))
    for k in ("created",):
        a.pop(k), b.pop(k)
    assert a == b
