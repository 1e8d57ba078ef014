"""A Mixture-of-Experts target through every stage: the tiny random Qwen3-MoE goes prompts -> regenerate (real
vLLM, in-process) -> cache -> train (a few steps) -> eval (ours) -> export. The draft never runs the target's MLP, so MoE must
change nothing downstream of loading; this test is what shows it."""

from __future__ import annotations

import json

import pytest

from deepspec.targets import save_tiny_target

ENGINE = "vllm"  # the in-process engine the quickstart regenerates with: vLLM's own MoE layers answer the prompts
# vLLM's CPU attention kernels take head sizes 32, 64, 80, ... only: the tiny default (head_dim 16) fails at start-up
# with "Unsupported CPU attention configuration: head_dim=16". HEAD_DIM 64 is the size those kernels are built around.
HEAD_DIM = 64
# The tiny vocabulary (320) pads 60 ids past the byte tokenizer's 260; a random target's greedy answers often
# repeat one of those ids, which decode to nothing, and an empty answer leaves no sample to train on. VOCAB = the
# tokenizer's own size, so every id the target emits is a byte or a special token.
VOCAB = 260


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_moe_target_through_the_whole_pipeline(tmp_path, monkeypatch, one_torch_thread):
    from deepspec.config import load_config, save_config
    from deepspec.data.cache.format import load_manifest
    from deepspec.drafts.checkpoint import load_draft
    from deepspec.export.writers import export_draft
    from deepspec.pipeline import run

    pytest.importorskip("vllm")
    monkeypatch.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
    target = save_tiny_target(tmp_path / "tiny-qwen3-moe", "qwen3_moe", head_dim=HEAD_DIM, vocab_size=VOCAB)
    opts = [
        f"output_root={tmp_path / 'out'}", f"train.output_root={tmp_path / 'ckpt'}", f"target.name={target}", "target.dtype=float32",
        "data.prompts.source=embedded", "data.prompts.max_samples=10", "data.prompts.heldout=2", "data.prompts.first_turn_only=true",
        "data.prompts.max_prompt_chars=200", f"data.regenerate.engine={ENGINE}", "data.regenerate.sampling.max_tokens=24",
        "cache.max_length=512", "cache.min_loss_tokens=4", "model.algorithm=eagle3", "model.target_layer_ids=[0,2,4]",
        "model.draft_vocab_size=64", "model.intermediate_size=64", "train.max_steps=3", "train.global_batch_size=2",
        "train.micro_batch_size=2", "train.precision=fp32", "train.val_every=3", "train.save_every=3", "train.warmup_ratio=0.0",
        "logging.wandb=false", "eval.tasks=[heldout]", "eval.max_samples=1", "eval.max_new_tokens=12", "eval.measure_speedup=false",
        "eval.num_workers=1",
    ]
    recipe = tmp_path / "moe.yaml"
    save_config(load_config(None, opts), tmp_path, "moe.yaml")
    (res,) = run([str(recipe)], [], stages=("prompts", "regenerate", "cache", "train", "eval"), engine=False)
    cfg = res.cfg

    regenerated = [json.loads(x) for x in cfg.regenerated_path.read_text().splitlines() if x.strip()]
    assert len(regenerated) >= 6 and all(r["conversations"][-1]["role"] == "assistant" for r in regenerated)
    assert regenerated[0]["meta"]["engine"].startswith(ENGINE)
    manifest = load_manifest(cfg.cache_train_dir)
    assert manifest["target_architecture"] == "Qwen3MoeForCausalLM" and manifest["taps"] == [0, 2, 4]
    assert manifest["counts"]["samples"] >= 6
    assert res.checkpoint is not None and res.checkpoint.name == "step_3"
    draft = load_draft(res.checkpoint)
    assert draft.arch.target_model_type == "qwen3_moe" and draft.fc.in_features == 3 * 64  # 3 taps x hidden 64 (head_dim is per head)
    assert res.results["overall"]["rounds"] > 0 and res.results["overall"]["tau"] >= 1.0
    out = export_draft(res.checkpoint, tmp_path / "export", "vllm", target=str(target))
    exported = json.loads((out / "config.json").read_text())
    assert exported["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert exported["architectures"] == ["Eagle3Qwen3ForCausalLM"]  # Qwen3-MoE layers carry q/k norms
    assert (out / "model.safetensors").is_file()
