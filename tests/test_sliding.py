"""Sliding-window draft layers: the window bites (window < T changes outputs, window >= T equals full
attention), and the training attention is what the proposers compute at decoding time."""

from __future__ import annotations


import pytest
import torch

from deepspec.config.model import ModelConfig
from deepspec.drafts import DraftBatch, get_algorithm
from deepspec.drafts.checkpoint import target_weights
from deepspec.errors import ConfigError
from deepspec.targets import capture, tiny_target

T = 20


def _setup(algorithm: str, window: int | None, layers: int = 2):
    torch.manual_seed(0)
    model, _ = tiny_target("llama" if algorithm == "eagle3" else "qwen3")
    types = None if window is None else ["sliding_attention"] + ["full_attention"] * (layers - 1)
    cfg = ModelConfig(
        algorithm=algorithm, target_layer_ids=[0, 2, 4], num_draft_layers=layers, ttt_length=4, block_size=4, num_anchors=4,
        markov_rank=8, layer_types=types, sliding_window=window,
    )
    draft = get_algorithm(algorithm).from_target_config(model.config, cfg)
    draft.load_target_weights(*target_weights(model))
    draft.eval()
    ids = torch.randint(0, 250, (1, T), generator=torch.Generator().manual_seed(2))
    taps, final = capture(model, ids, draft.taps)
    return model, draft, ids, taps, final


def _eagle3_logits(window):
    _, d, ids, taps, _ = _setup("eagle3", window)
    with torch.no_grad():
        return [lg for _, lg in d.ttt_steps(ids, taps)]


def _block_hidden(algorithm, window):
    _, d, ids, taps, final = _setup(algorithm, window)
    ones = torch.ones_like(ids, dtype=torch.bool)
    anchors = torch.tensor([[2, 9, 13, 16]])
    with torch.no_grad():
        return d.block_hidden(DraftBatch(ids, ones, ones, taps, final), anchors, torch.ones_like(anchors, dtype=torch.bool))


@pytest.mark.slow
def test_eagle3_window_bites_and_a_wide_window_is_full_attention():
    full = _eagle3_logits(None)
    wide = _eagle3_logits(T + 4)  # covers every query's keys (query positions reach T-1+3)
    narrow = _eagle3_logits(4)
    for f, w in zip(full, wide):
        torch.testing.assert_close(w, f, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(narrow[0][:, -5:], full[0][:, -5:], atol=1e-4)
    torch.testing.assert_close(narrow[0][:, :4], full[0][:, :4], rtol=1e-5, atol=1e-5)  # rows < window see everything


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_block_window_bites_and_a_wide_window_is_full_attention(algorithm):
    full = _block_hidden(algorithm, None)
    torch.testing.assert_close(_block_hidden(algorithm, T + 4), full, rtol=1e-5, atol=1e-5)
    narrow = _block_hidden(algorithm, 4)  # the shortest window a block of 4 allows (config/model.py)
    assert not torch.allclose(narrow[0, 3], full[0, 3], atol=1e-4)  # anchor 16: context 0..15 cut to 13..15


@pytest.mark.parametrize("r", [3, 12])
def test_eagle3_proposer_equals_training_with_a_sliding_layer(r):
    _, d, ids, taps, _ = _setup("eagle3", 3)
    k_n = d.model_cfg.ttt_length
    prop = d.proposer()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        toks, probs = prop.propose(ids[0, : r + 2], taps[0, : r + 1], 0, k_n, temperature=1.0, generator=gen)
        # the training chain on the same tokens: row r at step k reads the proposer's k-th token
        chain = torch.cat([ids[0, : r + 2], toks[:-1]]).unsqueeze(0)
        t2 = chain.shape[1]
        tp = torch.cat([taps[0, : r + 1], taps[0, :1].expand(t2 - r - 1, -1, -1)]).unsqueeze(0)
        steps = [lg for _, lg in d.ttt_steps(chain, tp)]
    for k in range(k_n):
        torch.testing.assert_close(torch.softmax(steps[k][0, r].float(), -1), probs[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
@pytest.mark.parametrize("anchor", [2, 15])
def test_block_proposer_equals_training_with_a_sliding_layer(algorithm, anchor):
    _, d, ids, taps, final = _setup(algorithm, 4)
    prop = d.proposer()
    with torch.no_grad():
        prop.propose(ids[0, : anchor + 1], taps[0, :anchor], 0, d.num_predictions)
        ones = torch.ones_like(ids, dtype=torch.bool)
        a = torch.tensor([[anchor]])
        h = d.block_hidden(DraftBatch(ids, ones, ones, taps, final), a, torch.ones_like(a, dtype=torch.bool))[0, 0, d.first_slot :]
    torch.testing.assert_close(prop.last_hidden, h, rtol=1e-5, atol=1e-5)


def test_sliding_settings_are_validated_and_exported():
    with pytest.raises(ConfigError, match="sliding_window"):
        ModelConfig(layer_types=["sliding_attention"]).validate()
    with pytest.raises(ConfigError, match="one entry per draft layer"):
        ModelConfig(layer_types=["full_attention"] * 2, num_draft_layers=1).validate()
    _, d, *_ = _setup("dflash", 5)
    arch = d.export_config()["arch"]
    assert arch["layer_types"] == ["sliding_attention", "full_attention"] and arch["sliding_window"] == 5
    from deepspec.export.writers import _sizes

    cfg = _sizes(arch, "qwen3")
    assert cfg["layer_types"] == arch["layer_types"] and cfg["sliding_window"] == 5 and cfg["use_sliding_window"]
