"""Golden tests for the block drafters (DFlash, DSpark): masks, labels, prefix masks, proposer
consistency, chunked full-vocabulary terms, sequential Markov decoding."""

from __future__ import annotations

import pytest
import torch

from deepspec.config.model import ModelConfig
from deepspec.drafts import DraftBatch, get_algorithm
from deepspec.drafts.block import default_mask_token_id
from deepspec.drafts.checkpoint import target_weights
from deepspec.targets import capture, tiny_target


def _setup(algorithm: str, family: str = "qwen3", **kw):
    torch.manual_seed(0)
    model, _ = tiny_target(family)
    kw.setdefault("target_layer_ids", [0, 2, 4])
    cfg = ModelConfig(algorithm=algorithm, block_size=4, num_anchors=3, markov_rank=8, **kw)
    draft = get_algorithm(algorithm).from_target_config(model.config, cfg)
    draft.load_target_weights(*target_weights(model))
    if algorithm == "dspark":
        torch.nn.init.normal_(draft.markov_head.markov_w2.weight, std=0.5)
    ids = torch.randint(0, 250, (2, 18), generator=torch.Generator().manual_seed(1))
    taps, final = capture(model, ids, draft.taps)
    return model, draft, ids, taps, final


def _batch(ids, taps, final, lm=None):
    ones = torch.ones_like(ids, dtype=torch.bool)
    return DraftBatch(ids, ones if lm is None else lm, ones, taps, final)


def test_block_mask_strict_prefix_and_isolation():
    _, d, ids, _, _ = _setup("dflash")
    anchors = torch.tensor([[3, 7], [5, 0]])
    keep = torch.tensor([[True, True], [True, False]])
    bids, pos, mask = d.block_inputs(ids, anchors, keep, torch.ones_like(ids, dtype=torch.bool))
    t, k = ids.shape[1], d.block_size
    assert bids[0].tolist() == [int(ids[0, 3])] + [d.mask_token_id] * 3 + [int(ids[0, 7])] + [d.mask_token_id] * 3
    assert pos[0].tolist() == [3, 4, 5, 6, 7, 8, 9, 10]
    m = mask[0, 0]
    for q in range(k):  # block 0 (anchor 3): context 0..2 only, its own slots, not block 1
        assert m[q, :t].nonzero().flatten().tolist() == [0, 1, 2]
        assert m[q, t : t + k].all() and not m[q, t + k :].any()
    for q in range(k, 2 * k):  # block 1 (anchor 7): never its own anchor's hidden state (position 7)
        assert m[q, :t].nonzero().flatten().tolist() == list(range(7))
        assert not m[q, t : t + k].any() and m[q, t + k :].all()
    dummy = mask[1, 0, k:]
    assert not dummy[:, :t].any()  # a dummy block sees no context


@pytest.mark.parametrize("algorithm,sfa", [("dflash", False), ("dspark", True), ("dflash", True)])
def test_labels_and_contiguous_prefix_mask(algorithm, sfa):
    _, d, ids, _, _ = _setup(algorithm, sample_from_anchor=sfa)
    assert d.num_predictions == (4 if sfa else 3)
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[:, 10] = False
    anchors = torch.tensor([[2, 7, 15], [0, 8, 16]])
    labels, emask, _ = d.block_labels(ids, lm, torch.ones_like(lm), anchors, torch.ones_like(anchors, dtype=torch.bool))
    # prediction p of anchor a is token a+1+p
    assert labels[0, 0].tolist() == ids[0, 3 : 3 + d.num_predictions].tolist()
    # anchor 7: labels 8, 9, [10 not loss-masked] -> only 8, 9 supervised even though 11 is
    assert emask[0, 1].tolist()[:4 if sfa else 3] == ([True, True, False, False] if sfa else [True, True, False])
    # anchor 15 of 18 tokens: labels 16, 17, then past the end
    assert emask[0, 2].tolist()[:2] == [True, True] and not emask[0, 2, 2:].any()
    assert emask[1, 0].all()


def test_anchor_sampling_only_valid_positions():
    _, d, ids, _, _ = _setup("dflash")
    lm = torch.zeros_like(ids, dtype=torch.bool)
    lm[0, 5:9] = True  # valid anchors 5, 6, 7 (a and a+1 both response tokens)
    lm[1, 12:14] = True  # only 12
    for _ in range(5):
        anchors, keep = d.sample_anchors(lm, torch.ones_like(lm))
        assert anchors[0].tolist() == [5, 6, 7] and keep[0].all()
        assert anchors[1, keep[1]].tolist() == [12] and keep[1].sum() == 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_proposer_block_equals_training_block(family, algorithm):
    """The decoding block for anchor a (context = taps of positions < a) equals the training block of a."""
    _, d, ids, taps, final = _setup(algorithm, family)
    anchors = torch.tensor([[4, 9, 13]])
    with torch.no_grad():
        train_h = d.block_hidden(_batch(ids[:1], taps[:1], final[:1]), anchors, torch.ones(1, 3, dtype=torch.bool))
    prop = d.proposer()
    prop.propose(ids[0, :5], taps[0, :4], 0, 2)
    torch.testing.assert_close(prop.last_hidden, train_h[0, 0, d.first_slot :], atol=1e-5, rtol=1e-4)
    prop.propose(ids[0, :14], taps[0, 4:13], 4, 2)  # incremental context extension
    torch.testing.assert_close(prop.last_hidden, train_h[0, 2, d.first_slot :], atol=1e-5, rtol=1e-4)
    prop.propose(ids[0, :10], taps[0, 0:0], 9, 2)  # roll back to position 9 (drops rejected context)
    torch.testing.assert_close(prop.last_hidden, train_h[0, 1, d.first_slot :], atol=1e-5, rtol=1e-4)


def test_block_never_sees_own_anchor_hidden_or_future():
    _, d, ids, taps, final = _setup("dflash")
    anchors = torch.tensor([[6, 12]])
    keep = torch.ones(1, 2, dtype=torch.bool)
    with torch.no_grad():
        h0 = d.block_hidden(_batch(ids[:1], taps[:1], final[:1]), anchors, keep)
        t2 = taps[:1].clone()
        t2[:, 6:] += 1.0  # anchor 6's own hidden state and later
        h1 = d.block_hidden(_batch(ids[:1], t2, final[:1]), anchors, keep)
    torch.testing.assert_close(h0[:, 0], h1[:, 0])
    assert not torch.allclose(h0[:, 1], h1[:, 1])


def test_chunked_terms_equal_unchunked():
    grads = []
    for rows in (3, 100000):
        _, d, ids, taps, final = _setup("dspark", markov_head_type="rnn", vocab_chunk_rows=rows)
        anchors = torch.tensor([[1, 5, 9], [2, 6, 12]])
        loss, metrics = d.loss(_batch(ids, taps, final), anchors)
        loss.backward()
        grads.append((loss.detach(), metrics["l1_loss"][0], d.fc.weight.grad.clone(), d.markov_head.cell.weight.grad.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_dspark_loss_terms_and_metrics():
    _, d, ids, taps, final = _setup("dspark")
    anchors = torch.tensor([[1, 5, 9], [2, 6, 12]])
    loss, m = d.loss(_batch(ids, taps, final), anchors)
    ce, l1, conf = (float(m[k][0] / m[k][1]) for k in ("ce_loss", "l1_loss", "confidence_loss"))
    torch.testing.assert_close(loss, torch.tensor(0.1 * ce + 0.9 * l1 + 1.0 * conf), atol=1e-4, rtol=1e-4)
    assert 0 < l1 <= 2
    assert float(m["alpha_tf@1"][1]) == 6 and float(m["expected_tau"][1]) == 6
    a1 = float(m["alpha_tf@1"][0] / 6)
    assert abs(a1 - (1 - 0.5 * float(m["l1_loss"][0]) / float(m["l1_loss"][1]))) < 0.5  # same TV scale
    loss.backward()
    assert d.confidence_head.proj.weight.grad is not None and d.markov_head.markov_w1.weight.grad is not None


def test_dspark_sequential_sampling_uses_sampled_prev_and_threshold():
    _, d, ids, taps, _ = _setup("dspark")
    prop = d.proposer()
    toks, probs = prop.propose(ids[0, :9], taps[0, :8], 0, 3, temperature=1.0, generator=torch.Generator().manual_seed(3))
    h = prop.last_hidden
    with torch.no_grad():
        expect = torch.softmax(d.base_logits(h[1]) + d.markov_head.markov_w2(d.markov_head.markov_w1(toks[:1]))[0], -1)
    torch.testing.assert_close(probs[1], expect, atol=1e-6, rtol=1e-5)
    assert len(d.last_confidence) == 3
    d.model_cfg.confidence_threshold = 1.0
    toks, _ = d.proposer().propose(ids[0, :9], taps[0, :8], 0, 3)
    assert toks.numel() == 0


def test_mask_token_defaults():
    assert default_mask_token_id(49152) == 16  # SmolLM2 "<empty_output>"
    assert default_mask_token_id(151936) == 151669
    assert default_mask_token_id(320) == 319
    _, d, _, _, _ = _setup("dflash", mask_token_id=259)
    assert d.mask_token_id == 259


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_an_unlogged_step_trains_exactly_like_a_logged_one(algorithm):
    """train_metrics False (a step whose metrics nobody reads): the acceptance metrics are skipped, and DFlash, whose loss
    is CE alone, skips the target's distribution too (DSpark's L1 needs it) — the loss and every gradient bit for bit."""
    torch.manual_seed(0)
    model, _ = tiny_target("qwen3")
    cfg = ModelConfig(algorithm=algorithm, target_layer_ids=[0, 2, 4], block_size=4, num_anchors=4, markov_rank=8)
    d = get_algorithm(algorithm).from_target_config(model.config, cfg)
    d.load_target_weights(*target_weights(model))
    d.train()
    ids = torch.randint(0, 250, (2, 18), generator=torch.Generator().manual_seed(1))
    taps, final = capture(model, ids, d.taps)
    ones = torch.ones_like(ids, dtype=torch.bool)
    batch = DraftBatch(ids, ones, ones, taps, final)
    batch.plan = d.plan_batch(batch, key=5, buckets=False)
    out = {}
    for logged in (True, False):
        d.train_metrics = logged
        d.zero_grad()
        calls = []
        real = d.target_logits
        d.target_logits = lambda fh: calls.append(1) or real(fh)
        loss, metrics = d.loss(batch)
        del d.target_logits
        loss.backward()
        out[logged] = (loss.detach(), {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}, set(metrics), len(calls))
    assert torch.equal(out[False][0], out[True][0])
    assert all(torch.equal(out[False][1][n], g) for n, g in out[True][1].items())
    assert "_loss_weight" in out[False][2] and "expected_tau" in out[True][2] and "expected_tau" not in out[False][2]
    assert out[True][3] > 0 and out[False][3] == (0 if algorithm == "dflash" else out[True][3])
