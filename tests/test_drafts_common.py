"""Shared draft pieces: layers against HF's own decoder layer, d2t/t2d, checkpoint round trip."""

from __future__ import annotations

import json

import pytest
import torch

from deepspec.config.model import ModelConfig
from deepspec.drafts import DraftBatch, get_algorithm
from deepspec.drafts.checkpoint import load_draft, save_draft, target_weights
from deepspec.drafts.layers import DecoderLayer, arch_from_target, attend, causal_mask, RotaryEmbedding
from deepspec.drafts.vocab import build_draft_vocab, draft_ids_to_target
from deepspec.errors import CheckpointError, ConfigError
from deepspec.targets import capture, tiny_target


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decoder_layer_matches_hf_layer(family):
    """RoPE, GQA and (Qwen3) q/k norms reproduce HF's layer 0 exactly when given its weights."""
    model, _ = tiny_target(family)
    arch = arch_from_target(model.config, ModelConfig(num_draft_layers=1))
    assert arch.qk_norm == (family == "qwen3")
    layer = DecoderLayer(arch)
    missing, unexpected = layer.load_state_dict(model.model.layers[0].state_dict(), strict=False)
    assert not missing and not unexpected
    ids = torch.randint(0, 250, (2, 9))
    with torch.no_grad():
        hs = model.model(input_ids=ids, output_hidden_states=True).hidden_states
        x = hs[0]
        pos = torch.arange(9)
        cos, sin = RotaryEmbedding(arch)(pos[None].expand(2, 9), x.dtype)
        h = layer.input_layernorm(x)
        a = layer.self_attn
        k, v = a.project_kv(h, cos, sin)
        x = x + a.output(attend(a.project_q(h, cos, sin), k, v, causal_mask(pos, pos)[None, None]))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    torch.testing.assert_close(x, hs[1], atol=1e-5, rtol=1e-4)


def test_d2t_t2d_round_trip():
    counts = torch.zeros(50)
    counts[[3, 7, 7, 20, 41, 49]] = torch.tensor([5.0, 9.0, 9.0, 1.0, 5.0, 2.0])
    counts[10] = 5.0  # ties with 3 and 41: lower ids win
    d2t, t2d = build_draft_vocab(counts, 5)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    tids = draft_ids_to_target(torch.arange(5), d2t)
    assert tids.tolist() == [3, 7, 10, 41, 49]
    assert torch.nonzero(t2d).flatten().tolist() == tids.tolist()
    full_d2t, full_t2d = build_draft_vocab(counts, None)
    assert int(full_d2t.abs().sum()) == 0 and bool(full_t2d.all())
    with pytest.raises(ConfigError):
        build_draft_vocab(counts, 0)


def test_hidden_size_override_refused():
    model, _ = tiny_target("llama")
    with pytest.raises(ConfigError, match="hidden_size"):
        arch_from_target(model.config, ModelConfig(hidden_size=32))
    arch = arch_from_target(model.config, ModelConfig(intermediate_size=48, num_attention_heads=2, num_key_value_heads=1))
    assert (arch.intermediate_size, arch.num_attention_heads, arch.num_key_value_heads) == (48, 2, 1)


@pytest.mark.parametrize("algorithm", ["eagle3", "dflash", "dspark"])
def test_checkpoint_round_trip(tmp_path, algorithm):
    model, _ = tiny_target("qwen3")
    cfg = ModelConfig(algorithm=algorithm, target_layer_ids=[0, 2, 4], draft_vocab_size=64 if algorithm == "eagle3" else None, markov_head_type="gated", markov_rank=8, ttt_length=2, block_size=3, num_anchors=4)
    draft = get_algorithm(algorithm).from_target_config(model.config, cfg)
    draft.load_target_weights(*target_weights(model))
    ids = torch.randint(0, 250, (1, 12))
    draft.set_token_frequencies(torch.bincount(ids.flatten(), minlength=320).float())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.01 * torch.randn_like(p))
    prov = {"target": "tiny-qwen3", "taps": [0, 2, 4], "template_hash": "abc"}
    out = save_draft(draft, tmp_path / "step_1", prov)
    save_draft(draft, out, prov)  # overwrite atomically
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    meta = json.loads((out / "config.json").read_text())["deepspec"]
    assert meta["algorithm"] == algorithm and meta["provenance"] == prov and meta["taps"] == [0, 2, 4]
    from safetensors.torch import load_file

    stored = load_file(str(out / "model.safetensors"))
    assert "target_embed" not in stored and "target_lm_head" not in stored
    back = load_draft(out, target_model=model)
    for k, v in draft.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, msg=k)
    taps, final = capture(model, ids, draft.taps)
    ones = torch.ones_like(ids, dtype=torch.bool)
    batch = DraftBatch(ids, ones, ones, taps, final)
    torch.manual_seed(0)
    l1, _ = draft.loss(batch)
    torch.manual_seed(0)
    l2, _ = back.loss(batch)
    torch.testing.assert_close(l1, l2)
    with pytest.raises(CheckpointError):
        load_draft(tmp_path)


def test_gemma_style_options():
    """Gemma targets: (1 + weight) norms, sqrt(H)-scaled embeddings and final-logit soft-capping, in the
    same draft classes (no per-family copies)."""
    from transformers import Gemma2Config

    tc = Gemma2Config(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, final_logit_softcapping=5.0)
    for algorithm in ("eagle3", "dspark"):
        draft = get_algorithm(algorithm).from_target_config(tc, ModelConfig(algorithm=algorithm, target_layer_ids=[1, 3], block_size=3, markov_rank=4))
        arch = draft.arch
        assert arch.norm_offset == 1.0 and arch.embed_scale == 8.0 and arch.logit_softcap == 5.0 and arch.hidden_act == "gelu_pytorch_tanh"
        assert float(draft.norm.weight.detach().abs().sum()) == 0.0  # (1 + 0) * x at init
        torch.nn.init.normal_(draft.target_lm_head, std=10.0)
        ids = torch.randint(0, 300, (1, 10))
        ones = torch.ones_like(ids, dtype=torch.bool)
        batch = DraftBatch(ids, ones, ones, torch.randn(1, 10, 2, 64), torch.randn(1, 10, 64))
        loss, _ = draft.loss(batch)
        assert torch.isfinite(loss)
        assert float(draft.target_logits(batch.final_hidden).abs().max()) <= 5.0
