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
