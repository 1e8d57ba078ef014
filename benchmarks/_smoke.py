"""What the benchmarks' `--smoke` modes start from: a tiny random Llama target written to disk, a recipe over it with
random-word conversations, its caches and an untrained draft checkpoint — so each benchmark's own code path runs end to
end in seconds with nothing downloaded. Figures measured on these are checks of the code path, not results."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = "the cat sat on a mat and then ran far away from home while it rained all day long".split()
TAPS = [0, 2, 4]  # the tiny Llama has 6 layers


def smoke_env() -> None:
    """Offline, quiet: a smoke run must not reach a hub or draw progress bars."""
    for k, v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("WANDB_MODE", "offline"), ("DEEPSPEC_NO_PROGRESS", "1")):
        os.environ.setdefault(k, v)


def conversations(n: int, seed: int = 0, first_id: int = 0) -> list[dict]:
    """`n` random-word chats of one user and one assistant turn."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
        a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 24)))
        rows.append({"id": str(first_id + i), "conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_target(root: Path) -> Path:
    """The tiny Llama target (byte tokenizer, ChatML template) saved as an HF folder under `root`."""
    from deepspec.targets.tiny import save_tiny_target

    return save_tiny_target(root / "target", "llama")


def tiny_recipe(root: Path, *, samples: int = 8, heldout: int = 4, max_length: int = 96, train: str = "max_steps: 2",
                algorithm: str = "eagle3", extra: str = "") -> Path:
    """`root`/recipe.yaml: the quickstart EAGLE-3 recipe on the tiny target, with `samples` train and `heldout` held-out
    conversations already regenerated (so a smoke runs the pipeline from the cache stage on). `train`: YAML flow pairs of the train section."""
    target = tiny_target(root)
    data = root / "data"
    write_jsonl(data / "regenerated.jsonl", conversations(samples))
    held = conversations(heldout, seed=1, first_id=1000)
    write_jsonl(data / "regenerated.heldout.jsonl", held)
    write_jsonl(data / "heldout.jsonl", held)  # the held-out prompts the evaluator asks (`eval.tasks: [heldout]`)
    path = root / "recipe.yaml"
    model = f"algorithm: {algorithm}, target_layer_ids: {TAPS}, draft_vocab_size: null, init_copy_heads: false"
    path.write_text(f"""_base_: {REPO}/config/quickstart/eagle3.yaml
project: smoke
exp: e3
output_root: {root}/out
target: {{name: {target}, dtype: float32}}
data: {{dir: {data}}}
cache: {{max_length: {max_length}}}
model: {{{model}}}
train: {{output_root: {root}/ckpt, precision: fp32, global_batch_size: 2, micro_batch_size: 1, {train}}}
logging: {{progress: false, wandb: false, tensorboard: false}}
{extra}""")
    return path


def cached_split(recipe: Path, split: str = "heldout") -> Path:
    """Build the recipe's cache of `split` and return its folder."""
    from deepspec.config import load_config
    from deepspec.data.cache import build_cache

    return Path(build_cache(load_config(recipe), split, nproc=1))


def untrained_checkpoint(recipe: Path, out: Path) -> Path:
    """A randomly initialised draft of the recipe, saved as a step folder (weights, config.json, config.yaml)."""
    import torch
    from transformers import AutoConfig

    from deepspec.config import load_config
    from deepspec.drafts.checkpoint import save_draft
    from deepspec.drafts.registry import get_algorithm

    cfg = load_config(recipe)
    torch.manual_seed(0)
    draft = get_algorithm(cfg.model.algorithm).from_target_config(AutoConfig.from_pretrained(cfg.target.name), cfg.model)
    return save_draft(draft, out / "step_0", provenance={"target": str(cfg.target.name), "target_path": str(cfg.target.name)},
                      config=cfg)
