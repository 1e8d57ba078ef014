"""A saved draft checkpoint for a tiny target with every tensor perturbed, norms included, so an export that swaps,
skips or mis-scales a tensor shows in an engine's forward (shared by the SGLang export and `deepspec check` tests);
and deliberately broken copies of an export (the `deepspec check` and vLLM conformance tests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from deepspec.config.model import ModelConfig
from deepspec.drafts import get_algorithm
from deepspec.drafts.checkpoint import save_draft
from deepspec.targets import tiny_config

# the prompts the served-draft tests train on and serve (vLLM conformance, served-acceptance contract): six short,
# varied requests whose greedy answers a small draft learns in a few dozen steps
SERVED_PROMPTS = [
    "List the days of the week in order, one per line.",
    "Write a Python function that returns the factorial of n.",
    "Explain in three sentences why the sky is blue.",
    "Count from one to twenty in words.",
    "Give a short recipe for pancakes.",
    "What are the planets of the solar system?",
]


def random_draft_checkpoint(out: Path, family: str, algorithm: str, head_dim: int | None = None, **fields):
    """(draft, checkpoint folder `out`) for tiny-`family`: target taps 0, 2, 3 and block size 4 unless `fields` say
    otherwise; an EAGLE-3 draft vocabulary from rising token counts. `head_dim`: the target's (and so the draft's)
    attention head size instead of the tiny config's 16 (vLLM's CPU kernels take 32 and up)."""
    fields.setdefault("target_layer_ids", [0, 2, 3])
    fields.setdefault("block_size", 4)
    cfg = ModelConfig(algorithm=algorithm, **fields)
    torch.manual_seed(0)
    target = tiny_config(family)
    if head_dim is not None:
        target.head_dim = head_dim
    draft = get_algorithm(algorithm).from_target_config(target, cfg)
    if algorithm == "eagle3":
        draft.set_token_frequencies(torch.arange(320).float())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.05))
    prov = {"target": f"tiny-{family}", "target_vocab_size": 320, "target_hidden_size": 64, "target_num_layers": 6}
    return draft, save_draft(draft, out, prov)


def edit_export(src: Path, dst: Path, cfg_fn=None, tensors_fn=None) -> Path:
    """A copy of the export `src` at `dst` with its config.json edited by `cfg_fn` and its tensors by `tensors_fn`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if cfg_fn:
        cfg = json.loads((dst / "config.json").read_text())
        cfg_fn(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors_fn:
        t = load_file(str(dst / "model.safetensors"))
        tensors_fn(t)
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# --- confidence-head breakages that `deepspec check` must catch, in vLLM's class and in SGLang's ----------------------

BAKED = (0.4, -0.6)  # the calibration a calibrated DSpark export bakes (close to the quickstart's T = 1 fit)


def declare_calibration(cfg):
    """config.json says the calibration is baked, the weights hold the raw head (a writer that forgot to bake)."""
    cfg["deepspec"]["confidence_calibration"] = {"baked": {"a": BAKED[0], "b": BAKED[1], "temperature": 1.0}}


def roll_confidence_head(t):
    """The confidence head's input columns one off: every weight stays, each multiplies its neighbour's feature."""
    t["confidence_head.proj.weight"] = t["confidence_head.proj.weight"].roll(1, 1)


def drop_confidence_head(t):
    """No confidence weights: vLLM's load_weights drops the head (adaptive verification falls back to its estimator);
    SGLang's confidence-driven verify modes refuse the checkpoint."""
    for k in [k for k in t if k.startswith("confidence_head.")]:
        t.pop(k)
