"""The tiny multi-stream (hyper-connection) target `tiny-mhc`: deterministic, loadable by name, and its taps
(per stream and reduced) pinned against its own forward."""

from __future__ import annotations

import pytest
import torch

from deepspec.targets import capture
from deepspec.targets.taps import reduce_streams, select_taps, tap_width
from deepspec.targets.tiny_mhc import tiny_mhc_target


def test_mhc_streams_are_distinct_and_deterministic():
    model, tok = tiny_mhc_target()
    ids = tok("the cat sat on the mat", return_tensors="pt")["input_ids"]
    out = model(ids, output_hidden_states=True)
    S, H = model.config.hc_mult, model.config.hidden_size
    assert S == 4
    assert all(h.shape == (1, ids.shape[1], S, H) for h in out.hidden_states)
    h2 = out.hidden_states[3][0]
    assert not torch.allclose(h2[:, 0], h2[:, 1])  # the learned write/mix weights separate the streams
    again, _ = tiny_mhc_target()
    assert torch.equal(again(ids).logits, out.logits)
    other, _ = tiny_mhc_target(seed=1)
    assert not torch.equal(other(ids).logits, out.logits)


def test_mhc_taps_per_stream_and_reduced_match_forward():
    """Golden: each stream of tap k is stream s of layer k's output; mean / concat are their mean / concatenation."""
    model, _ = tiny_mhc_target()
    ids = torch.randint(0, 256, (2, 10))
    att = torch.ones_like(ids)
    att[0, 7:] = 0
    with torch.no_grad():
        ref = model.model(input_ids=ids, attention_mask=att, output_hidden_states=True)
    taps = [-1, 1, 3]
    S, H = model.config.hc_mult, model.config.hidden_size
    mean, final = capture(model, ids, taps, attention_mask=att, reduction="mean")
    cat, _ = capture(model, ids, taps, attention_mask=att, reduction="concat")
    assert mean.shape == (2, 10, 3, H) and cat.shape == (2, 10, 3, S * H) and tap_width(H, S, "concat") == S * H
    for j, k in enumerate(taps):
        streams = ref.hidden_states[k + 1]
        for s in range(S):
            assert torch.allclose(cat[:, :, j, s * H:(s + 1) * H], streams[:, :, s], atol=1e-6)
        assert torch.allclose(mean[:, :, j], streams.mean(2), atol=1e-6)
    emb = model.model.embed_tokens(ids)
    assert torch.allclose(cat[:, :, 0], emb.repeat(1, 1, S))  # the embeddings enter every stream
    assert torch.allclose(final, ref.last_hidden_state, atol=1e-6)
    assert torch.allclose(model.lm_head(final), model(ids, attention_mask=att).logits, atol=1e-5)
    assert torch.equal(select_taps(ref.hidden_states, taps, "concat"), reduce_streams(torch.stack([ref.hidden_states[k + 1] for k in taps], 2), "concat"))


def test_mhc_kv_cache_decoding_matches_full_forward():
    """The evaluator decodes with a DynamicCache and crops it: incremental logits equal a full forward's."""
    from transformers import DynamicCache

    model, _ = tiny_mhc_target()
    ids = torch.randint(0, 256, (1, 12))
    full = model(ids).logits
    cache = DynamicCache(config=model.config)
    a = model(ids[:, :8], past_key_values=cache, use_cache=True).logits
    b = model(ids[:, 8:], past_key_values=cache, use_cache=True).logits
    assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-5)


def test_mhc_target_loads_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPSPEC_CACHE", str(tmp_path))
    from deepspec.targets import load_target

    target = load_target("tiny-mhc", device="cpu", dtype="float32")
    assert target.config.model_type == "deepspec_tiny_mhc" and target.provenance()["target_hc_mult"] == 4
    ref, _ = tiny_mhc_target()
    ids = torch.randint(0, 256, (1, 6))
    assert torch.allclose(target.model(ids).logits, ref(ids).logits, atol=1e-6)
    assert target.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>user")


# ------------------------------------------------------------------------ the DeepSeek-V4-Flash recipes on tiny-mhc

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]
WORDS = "the cat sat on a mat and then it ran far away to find some food while birds sang".split()


def _write_data(data_dir, n: int, name: str, seed: int) -> None:
    import json
    import random

    rng = random.Random(seed)
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / name, "w") as f:
        for i in range(n):
            conv = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=6))},
                    {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(12, 30)))}]
            f.write(json.dumps({"id": f"{name}-{i}", "conversations": conv}) + "\n")


# Small sizes for every recipe: the tiny target has 6 layers (taps -1..4), hidden 64, 4 streams, vocabulary 320.
SMALL = ["target.name=tiny-mhc", "target.dtype=float32", "target.device_map=null", "cache.max_length=96", "cache.dtype=bf16",
         "train.max_steps=2", "train.global_batch_size=2", "train.micro_batch_size=2", "train.precision=fp32",
         "train.val_every=2", "train.save_every=2", "train.val_max_samples=2", "train.warmup_ratio=0.0",
         "logging.wandb=false", "eval.tasks=[heldout]", "eval.max_samples=1", "eval.max_new_tokens=12",
         "eval.measure_speedup=false", "eval.num_workers=1"]
RECIPES = {
    "eagle3": ("config/eagle3/deepseek-v4-flash.yaml", ["model.target_layer_ids=[1,2,4]", "model.draft_vocab_size=64"]),
    "dflash": ("config/dflash/deepseek-v4-flash.yaml", ["model.target_layer_ids=[0,1,2,3,4]", "model.num_anchors=8",
                                                        "model.intermediate_size=64", "model.sliding_window=8", "model.draft_vocab_size=64"]),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("algo", ["eagle3", "dflash"])
def test_mhc_deepseek_v4_flash_recipe_end_to_end(algo, tmp_path, monkeypatch, one_torch_thread):
    """The V4-Flash recipe on tiny-mhc: cache -> 2 training steps -> eval (ours) -> export, in this process.
    The cache and the export record hc_mult and tap_reduction; the draft's fc reads W = H (mean) or S*H (concat)."""
    import json

    from deepspec.data.cache.format import load_manifest
    from deepspec.drafts.checkpoint import load_draft
    from deepspec.export.writers import export_draft
    from deepspec.pipeline import run

    monkeypatch.setenv("DEEPSPEC_CACHE", str(tmp_path / "dscache"))
    monkeypatch.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
    data = tmp_path / "data"
    _write_data(data, 8, "regenerated.jsonl", 0)
    _write_data(data, 2, "regenerated.heldout.jsonl", 1)
    _write_data(data, 2, "heldout.jsonl", 1)
    recipe, extra = RECIPES[algo]
    opts = [f"output_root={tmp_path / 'out'}", f"train.output_root={tmp_path / 'ckpt'}", f"data.dir={data}",
            f"cache.dir={tmp_path / 'cache'}", *SMALL, *extra]
    (res,) = run([str(REPO / recipe)], opts, stages=("cache", "train", "eval"), engine=False)
    S, H = 4, 64
    reduction = "mean" if algo == "eagle3" else "concat"
    manifest = load_manifest(tmp_path / "cache" / "train")
    assert (manifest["hc_mult"], manifest["tap_reduction"]) == (S, reduction)
    assert res.checkpoint is not None and res.checkpoint.name == "step_2"
    draft = load_draft(res.checkpoint)
    width = H if reduction == "mean" else S * H
    assert (draft.arch.target_hidden_size, draft.arch.target_hc_mult, draft.arch.tap_reduction) == (width, S, reduction)
    assert draft.fc.in_features == len(draft.taps) * width
    assert res.results["overall"]["rounds"] > 0 and res.results["overall"]["tau"] >= 1.0
    out = export_draft(res.checkpoint, tmp_path / "export", "vllm", target="tiny-mhc")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["target_hc_mult"], cfg["tap_reduction"], cfg["target_hidden_size"]) == (S, reduction, width)
    if algo == "eagle3":
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5]
    else:
        assert cfg["dflash_config"]["target_layer_ids"] == [0, 1, 2, 3, 4]
        assert draft.arch.layer_types == ["sliding_attention"] * 5 and draft.arch.sliding_window == 8
        # the recipe's draft vocabulary, built from the cache's token counts, reaches the export
        import numpy as np

        from deepspec.drafts.vocab import build_draft_vocab

        counts = torch.from_numpy(np.load(tmp_path / "cache" / "train" / "token_counts.npy"))
        assert cfg["draft_vocab_size"] == 64 and torch.equal(draft.d2t, build_draft_vocab(counts, 64)[0])


def test_mhc_training_refuses_a_cache_with_another_tap_reduction(tmp_path, monkeypatch):
    from deepspec.config import load_config
    from deepspec.data.cache.writer import build_cache
    from deepspec.errors import CacheError
    from deepspec.train.build import open_cache_datasets

    monkeypatch.setenv("DEEPSPEC_CACHE", str(tmp_path / "dscache"))
    monkeypatch.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
    data = tmp_path / "data"
    _write_data(data, 3, "regenerated.jsonl", 0)
    recipe = REPO / "config/eagle3/deepseek-v4-flash.yaml"
    opts = [f"data.dir={data}", f"cache.dir={tmp_path / 'cache'}", *SMALL, "model.target_layer_ids=[0,2]"]
    build_cache(load_config(recipe, [*opts, "model.tap_reduction=concat"]), "train")
    with pytest.raises(CacheError, match=r"tap_reduction: cache has 'concat', run wants 'mean' \(model.tap_reduction\)"):
        open_cache_datasets(load_config(recipe, opts))
    # `deepspec run` refuses at its cache stage, before training starts, instead of reusing the project's cache
    from deepspec.pipeline import stage_cache

    with pytest.raises(CacheError, match=r"tap_reduction: cache has 'concat', run wants 'mean'"):
        stage_cache(load_config(recipe, opts))
    skipped, detail = stage_cache(load_config(recipe, [*opts, "model.tap_reduction=concat"]))  # the matching recipe reuses it
    assert skipped and detail["samples"] == 3


def _readme_v4_block() -> str:
    """The README's bash block that trains both DeepSeek-V4-Flash recipes on tiny-mhc."""
    import re

    text = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "deepseek-v4-flash.yaml" in b and "tiny-mhc" in b]
    assert len(blocks) == 1, "the README shows the V4-Flash commands on tiny-mhc in one bash block"
    return blocks[0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mhc_readme_v4_flash_commands_train_both_recipes(tmp_path):
    """The README's exact commands (only the output folders moved into tmp_path): prompts -> regenerate -> cache on
    tiny-mhc, then train.sh with 2 workers for the DFlash recipe (on concatenated streams), then the EAGLE-3.1 recipe
    on its own cache (their mean)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    block = _readme_v4_block()
    moved = block.replace('TINY="', f'TINY="output_root={tmp_path / "out"} train.output_root={tmp_path / "ckpt"} ', 1)
    moved = moved.replace("cache.dir=outputs/", f"cache.dir={tmp_path / 'out'}/")
    assert moved.count(str(tmp_path)) == 3, "the README block's shape changed: update this test's redirection"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               DEEPSPEC_CACHE=str(tmp_path / "dscache"), DEEPSPEC_CACHE_DEVICE="cpu", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline", DEEPSPEC_NO_PROGRESS="1")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", moved], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=840)
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    from deepspec.drafts.checkpoint import load_draft

    for exp, width, reduction in (("dflash", 4 * 64, "concat"), ("eagle3", 64, "mean")):
        steps = sorted((tmp_path / "ckpt" / "deepseek-v4-flash").glob(f"{exp}*/step_6"))
        assert len(steps) == 1, sorted((tmp_path / "ckpt").rglob("step_*"))
        arch = load_draft(steps[0]).arch
        assert (arch.target_hidden_size, arch.tap_reduction) == (width, reduction)
    for cache, reduction, taps in (("cache", "concat", [0, 1, 2, 3, 4]), ("cache-eagle3", "mean", [1, 2, 4])):
        manifest = json.loads((tmp_path / "out" / "deepseek-v4-flash" / cache / "train" / "manifest.json").read_text())
        assert (manifest["hc_mult"], manifest["tap_reduction"], manifest["taps"]) == (4, reduction, taps)
