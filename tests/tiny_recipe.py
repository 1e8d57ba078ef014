"""A recipe on a tiny target with its train and held-out caches built: what the trainer tests start from.

The conversations are random words; `train` and `model` are YAML flow mappings merged over the quickstart EAGLE-3
recipe, so each test module says only what it changes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
WORDS = "the cat sat on a mat and then ran far away from home while it rained all day long".split()


def conversation(rng: random.Random, i: int, answer: tuple[int, int] = (6, 24)) -> dict:
    q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
    a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*answer)))
    return {"id": str(i), "conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def write_regenerated(data: Path, samples: int, name: str = "regenerated.jsonl", seed: int = 0) -> Path:
    """`samples` random conversations as `data`/`name` (the folder is made): the input a cache build reads."""
    data.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    (data / name).write_text("".join(json.dumps(conversation(rng, i)) + "\n" for i in range(samples)))
    return data / name


def cached_recipe(root: Path, target_dir: Path, *, samples: int, heldout: int, max_length: int, train: str, model: str = "",
                  cache: str = "", project: str = "t", exp: str = "e3", logging: str = "wandb: false, tensorboard: false",
                  answer: tuple[int, int] = (6, 24), build: tuple[str, ...] = ("train", "heldout")) -> Path:
    """Write `root`/recipe.yaml over `samples` + `heldout` conversations (answers of `answer` words) and build the
    caches named in `build`; returns its path. train / model / cache / logging: extra `key: value` pairs of those
    sections (YAML flow syntax, without braces; `model` may override the defaults here)."""
    from deepspec.config import load_config
    from deepspec.data.cache import build_cache

    data = root / "data"
    data.mkdir(parents=True)
    rng = random.Random(0)
    (data / "regenerated.jsonl").write_text("".join(json.dumps(conversation(rng, i, answer)) + "\n" for i in range(samples)))
    (data / "regenerated.heldout.jsonl").write_text("".join(json.dumps(conversation(rng, 100 + i, answer)) + "\n" for i in range(heldout)))
    # copy heads need tap -1; `model` overrides these defaults key by key
    models = {"target_layer_ids": [0, 2, 4], "draft_vocab_size": None, "init_copy_heads": False, **yaml.safe_load(f"{{{model}}}")}
    model_yaml = yaml.safe_dump(models, default_flow_style=True, sort_keys=False, width=10**6).strip()
    path = root / "recipe.yaml"
    path.write_text(
        f"""_base_: {REPO}/config/quickstart/eagle3.yaml
project: {project}
exp: {exp}
output_root: {root}/out
target: {{name: {target_dir}}}
data: {{dir: {data}}}
cache: {{max_length: {max_length}{', ' + cache if cache else ''}}}
model: {model_yaml}
train: {{output_root: {root}/ckpt, {train}}}
logging: {{progress: false{', ' + logging if logging else ''}}}
"""
    )
    cfg = load_config(path)
    for split in build:
        build_cache(cfg, split)
    return path


def step_weights(step_dir: Path) -> dict:
    """The draft weights a run saved at one step (its model.safetensors)."""
    from safetensors.torch import load_file

    return load_file(str(step_dir / "model.safetensors"))


def max_weight_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two saved sets of the same weights (in float64)."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
