"""Golden alignment tests for EAGLE-3 / EAGLE-3.1 on tiny Llama and Qwen3 targets."""

from __future__ import annotations

import pytest
import torch

from deepspec.config.model import ModelConfig
from deepspec.drafts import DraftBatch, get_algorithm
from deepspec.drafts.checkpoint import target_weights
from deepspec.drafts.layers import causal_mask
from deepspec.errors import ConfigError
from deepspec.targets import capture, tiny_target


def _setup(family: str, **kw):
    torch.manual_seed(0)
    model, _ = tiny_target(family)
    kw.setdefault("target_layer_ids", [0, 2, 4])
    cfg = ModelConfig(algorithm="eagle3", ttt_length=kw.pop("ttt_length", 4), **kw)
    draft = get_algorithm("eagle3").from_target_config(model.config, cfg)
    draft.load_target_weights(*target_weights(model))
    for p in draft.parameters():  # random but non-trivial norms so flags matter
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(1))
    taps, final = capture(model, ids, draft.taps)
    return model, draft, ids, taps, final


def _batch(ids, taps, final, loss_mask=None):
    ones = torch.ones_like(ids, dtype=torch.bool)
    return DraftBatch(ids, ones if loss_mask is None else loss_mask, ones, taps, final)


def _naive_chain(draft, ids, taps, r, steps):
    """Recompute row r's TTT chain from scratch: step 0 over the prefix rows 0..r only, then one
    token at a time at positions r+1, r+2, ... attending to everything cached so far."""
    emb = draft.embed(ids[None, 1 : r + 2])
    hidden = draft.combine_taps(taps[None, : r + 1])
    pos = torch.arange(r + 1)
    logits, hid, cache = draft.step(emb, hidden, pos[None], None, causal_mask(pos, pos)[None, None])
    out = [logits[0, -1]]
    hid = hid[:, -1:]
    for k in range(1, steps):
        e = draft.embed(ids[None, r + 1 + k : r + 2 + k])
        lg, hid, kv = draft.step(e, hid, torch.tensor([[r + k]]), cache, None)
        cache = [(torch.cat([c[0], x[0]], 2), torch.cat([c[1], x[1]], 2)) for c, x in zip(cache, kv)]
        out.append(lg[0, -1])
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_ttt_step_k_matches_naive_chain(family):
    _, draft, ids, taps, _ = _setup(family, draft_vocab_size=200)
    with torch.no_grad():
        steps = {k: lg for k, lg in draft.ttt_steps(ids, taps)}
        assert len(steps) == 4
        for r in (0, 5, 10):
            naive = _naive_chain(draft, ids[1], taps[1], r, 4)
            for k in range(4):
                torch.testing.assert_close(steps[k][1, r], naive[k], atol=2e-5, rtol=1e-4)


def test_ttt_step_k_does_not_see_future_rows():
    _, draft, ids, taps, _ = _setup("llama")
    with torch.no_grad():
        before = [lg.clone() for _, lg in draft.ttt_steps(ids, taps)]
        ids2, taps2 = ids.clone(), taps.clone()
        ids2[:, 12:] = 7
        taps2[:, 9:] += 1.0
        after = [lg for _, lg in draft.ttt_steps(ids2, taps2)]
    for k in range(4):
        # row r at step k reads tokens up to r+1+k and taps up to r: rows r <= 8 and r+1+k <= 11 are unchanged
        last = min(8, 10 - k)
        torch.testing.assert_close(before[k][:, : last + 1], after[k][:, : last + 1])
        assert not torch.allclose(before[k][:, last + 1 : 12], after[k][:, last + 1 : 12])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_proposer_matches_training_forward(family):
    _, draft, ids, taps, _ = _setup(family, draft_vocab_size=150)
    seq, seq_taps = ids[0], taps[0]
    with torch.no_grad():
        step0 = next(iter(draft.ttt_steps(ids[:1, :12], taps[:1, :12])))[1]
    prop = draft.proposer()
    toks, probs = prop.propose(seq[:12], seq_taps[:11], 0, 3)
    # first draft logits = training step-0 logits of the last row (L-2 = 10)
    torch.testing.assert_close(prop.last[0], step0[0, 10], atol=1e-5, rtol=1e-4)
    tid = draft.draft_target_ids()[step0[0, 10].argmax()]
    assert int(toks[0]) == int(tid) and probs[0, tid] == 1.0 and probs.shape == (3, 320)
    assert bool(draft.t2d[toks].all())
    # incremental: a second call that rejects the drafts and adds 3 committed tokens equals a fresh one-shot call
    toks2, _ = prop.propose(seq[:15], seq_taps[11:14], 11, 3)
    fresh = draft.proposer()
    toks3, _ = fresh.propose(seq[:15], seq_taps[:14], 0, 3)
    torch.testing.assert_close(prop.last[0], fresh.last[0], atol=1e-5, rtol=1e-4)
    assert toks2.tolist() == toks3.tolist()
    # sampling returns a proper distribution over the draft vocabulary only
    t, p = fresh.propose(seq[:15], seq_taps[14:14], 14, 2, temperature=1.0, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(p.sum(-1), torch.ones(2))
    assert float(p[:, ~draft.t2d].sum()) == 0.0 and p[0, t[0]] > 0


def test_loss_metrics_and_gradients():
    _, draft, ids, taps, final = _setup("qwen3", draft_vocab_size=200)
    lm = torch.zeros_like(ids, dtype=torch.bool)
    lm[:, 3:] = True
    loss, metrics = draft.loss(_batch(ids, taps, final, lm))
    loss.backward()
    assert draft.fc.weight.grad is not None and draft.lm_head.weight.grad is not None
    assert draft.midlayer.self_attn.q_proj.weight.grad.shape[1] == 2 * draft.arch.hidden_size
    assert not any("target" in n for n, _ in draft.named_parameters())
    # depth d predicts token r+1+d: loss-masked tokens 3..15 are all reachable at depth 1 (13 per
    # sequence), only tokens 5..15 at depth 4 (row r >= 0)
    assert float(metrics["alpha_tf@1"][1]) == 2 * 13
    assert float(metrics["alpha_tf@4"][1]) == 2 * 11
    for k in range(1, 5):
        a = float(metrics[f"alpha_tf@{k}"][0] / metrics[f"alpha_tf@{k}"][1])
        assert 0.0 < a < 1.0
    tau = float(metrics["expected_tau"][0] / metrics["expected_tau"][1])
    assert 1.0 < tau < 5.0
    assert "accept_rate" not in " ".join(metrics)


def test_unlogged_training_steps_give_the_same_loss_and_gradients_without_the_full_vocab_head():
    """train_metrics=False (set by the trainer on steps it does not log) keeps the loss and gradients and
    drops only the full-vocabulary metrics; evaluation mode always computes them."""
    _, draft, ids, taps, final = _setup("llama", draft_vocab_size=120)
    lm = torch.zeros_like(ids, dtype=torch.bool)
    lm[:, 2:] = True
    draft.train()
    results = []
    for flag in (True, False):
        draft.zero_grad()
        draft.train_metrics = flag
        loss, metrics = draft.loss(_batch(ids, taps, final, lm))
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}, metrics))
    (loss_on, grads_on, m_on), (loss_off, grads_off, m_off) = results
    torch.testing.assert_close(loss_off, loss_on, rtol=1e-6, atol=1e-6)
    assert grads_on.keys() == grads_off.keys() and grads_on
    for n in grads_on:
        torch.testing.assert_close(grads_off[n], grads_on[n], rtol=1e-5, atol=1e-6)
    assert set(m_off) - {"_loss_weight"} == {f"step_loss@{d}" for d in range(1, 5)}
    assert {"alpha_tf@1", "top1@1", "expected_tau", "greedy_tau"} <= set(m_on)
    draft.eval()
    assert "alpha_tf@1" in draft.loss(_batch(ids, taps, final, lm))[1]  # validation keeps every metric
    draft.train_metrics = True


def test_expected_tau_formula():
    a = [torch.tensor([[0.5, 0.8]]), torch.tensor([[0.5, 0.1]])]
    v = [torch.tensor([[True, True]]), torch.tensor([[True, False]])]
    out = get_algorithm("eagle3")._tau_metrics(a, [x.round() for x in a], v)
    # row 0: 1 + .5 + .25; row 1: 1 + .8 (depth 2 invalid)
    assert abs(float(out["expected_tau"][0]) - (1.75 + 1.8)) < 1e-6 and float(out["expected_tau"][1]) == 2


def test_eagle31_flags_change_exactly_what_they_should():
    _, d31, ids, taps, _ = _setup("llama", fc_norm=True, norm_output=True)
    names = set(d31.state_dict())
    assert {"fc_norm.0.weight", "fc_norm.2.weight"} <= names and "input_norm.weight" not in names
    big = taps * 100  # well above the norm's eps
    scaled = big * torch.tensor([2.0, 0.5, 3.0])[None, None, :, None]
    torch.testing.assert_close(d31.combine_taps(scaled), d31.combine_taps(big), atol=1e-4, rtol=1e-4)  # per-tap norm
    # norm_output: same step-0 logits, different later steps
    _, d30, _, _, _ = _setup("llama", fc_norm=True, norm_output=False)
    d30.load_state_dict(d31.state_dict())
    with torch.no_grad():
        s31 = [lg for _, lg in d31.ttt_steps(ids, taps)]
        s30 = [lg for _, lg in d30.ttt_steps(ids, taps)]
    torch.testing.assert_close(s31[0], s30[0])
    assert not torch.allclose(s31[1], s30[1])
    # legacy norm_before_fc: one norm over the concatenation, no per-tap norms
    _, dl, _, _, _ = _setup("llama", fc_norm=False, norm_before_fc=True)
    assert "input_norm.weight" in dl.state_dict() and not any(k.startswith("fc_norm") for k in dl.state_dict())
    with pytest.raises(ConfigError, match="mutually exclusive"):
        _setup("llama", fc_norm=True, norm_before_fc=True)


def test_alpha_tf_is_expected_acceptance_and_chunk_invariant():
    """alpha_tf@1 = sum_v min(p_draft(v), p_target(v)) with the full-vocab target distribution,
    whatever the row chunking of the target statistics."""
    _, draft, ids, taps, final = _setup("llama", draft_vocab_size=120)
    with torch.no_grad():
        step0 = next(iter(draft.ttt_steps(ids, taps)))[1]
        p_t = torch.softmax(final @ draft.target_lm_head.T, -1)[:, 1:-1]  # targets of rows 0..T-3
        p_d = torch.softmax(step0[:, :-2], -1)
        alpha = torch.minimum(p_d, p_t[..., draft.draft_target_ids()]).sum(-1)
    values = []
    for rows in (5, 100000):
        draft.model_cfg.vocab_chunk_rows = rows
        loss, m = draft.loss(_batch(ids, taps, final))
        values.append((loss.detach(), m["alpha_tf@1"][0], m["expected_tau"][0]))
    torch.testing.assert_close(values[0][1], alpha.sum(), atol=1e-4, rtol=1e-5)
    for a, b in zip(*values):
        torch.testing.assert_close(a, b)


def test_freeze_lm_head_keeps_target_rows():
    """model.freeze_lm_head: the head stays the target's rows for the draft vocab through training
    (the optimizer never sees it, it still reaches the checkpoint) while the rest trains."""
    torch.manual_seed(0)
    model, _ = tiny_target("llama")
    cfg = ModelConfig(algorithm="eagle3", target_layer_ids=[0, 2, 4], ttt_length=2, draft_vocab_size=64, freeze_lm_head=True)
    draft = get_algorithm("eagle3").from_target_config(model.config, cfg)
    draft.load_target_weights(*target_weights(model))
    counts = torch.arange(model.config.vocab_size, dtype=torch.float32)
    draft.set_token_frequencies(counts)
    rows = model.get_output_embeddings().weight[draft.draft_target_ids()].detach()
    assert torch.equal(draft.lm_head.weight.detach(), rows)
    assert not draft.lm_head.weight.requires_grad
    assert "lm_head.weight" in draft.state_dict()

    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(1))
    taps, final = capture(model, ids, draft.taps)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    before_fc = draft.fc.weight.detach().clone()
    loss, _ = draft.loss(_batch(ids, taps, final))
    loss.backward()
    opt.step()
    assert torch.equal(draft.lm_head.weight.detach(), rows)
    assert not torch.equal(draft.fc.weight.detach(), before_fc)  # the rest does train


def test_feature_noise_only_in_training_and_scaled_per_tap():
    """model.feature_noise perturbs the taps the draft reads in train mode only (eval and the
    proposer see the clean features), with an amplitude relative to each tap's per-token RMS."""
    _, draft, ids, taps, final = _setup("llama", draft_vocab_size=200, feature_noise=0.2)
    draft.eval()
    torch.testing.assert_close(draft._augment(taps), taps)
    with torch.no_grad():
        clean = [lg.clone() for _, lg in draft.ttt_steps(ids, taps)]
    draft.train()
    noisy = draft._augment(taps)
    rel = (noisy - taps).abs() / taps.pow(2).mean(-1, keepdim=True).sqrt()
    assert 0.1 < float(rel.max()) <= 0.2 + 1e-5  # U(-a, a) x RMS: bounded by a, and actually used
    with torch.no_grad():
        trained = [lg for _, lg in draft.ttt_steps(ids, taps)]
    assert not torch.allclose(clean[0], trained[0])
    with pytest.raises(ConfigError, match="feature_noise"):
        ModelConfig(feature_noise=1.5).validate()


def test_hidden_loss_pulls_normed_state_towards_next_target_state():
    """model.hidden_loss_weight adds smooth-L1(draft normed state of row r at step k, target final state
    of row r+1+k): zero when the draft reproduces it, positive otherwise, with gradients into the draft."""
    _, draft, ids, taps, final = _setup("qwen3", draft_vocab_size=200)
    base, _ = draft.loss(_batch(ids, taps, final))
    draft.model_cfg.hidden_loss_weight = 1.0
    with_h, _ = draft.loss(_batch(ids, taps, final))
    assert float(with_h.detach()) > float(base.detach())
    # Reproduce the extra term by hand for step 0 only (ttt_length=1).
    draft.model_cfg.ttt_length = 1
    draft.model_cfg.hidden_loss_weight = 0.0
    base1, _ = draft.loss(_batch(ids, taps, final))
    draft.model_cfg.hidden_loss_weight = 1.0
    with_h1, _ = draft.loss(_batch(ids, taps, final))
    with torch.no_grad():
        _, _, normed = next(iter(draft.ttt_steps(ids, taps, with_normed=True)))
        t = ids.shape[1]
        diff = normed[:, : t - 2] - final[:, 1 : t - 1]
        expected = torch.nn.functional.smooth_l1_loss(diff, torch.zeros_like(diff), reduction="none").mean(-1).mean()
    torch.testing.assert_close(with_h1 - base1, expected, atol=1e-5, rtol=1e-4)
    with_h1.backward()
    assert draft.fc.weight.grad is not None and float(draft.fc.weight.grad.abs().sum()) > 0


def test_ttt_inputs_draft_feeds_the_previous_steps_guess_in_training_only():
    """model.ttt_inputs=draft: TTT step k >= 1 of row r reads the draft's own step k-1 argmax for token
    r+1+k (mapped to target ids) instead of the data token — in training; validation keeps the data."""
    _, draft, ids, taps, _ = _setup("llama", draft_vocab_size=200, ttt_length=3, ttt_inputs="draft")
    seen = []
    embed = draft.embed
    draft.embed = lambda x: (seen.append(x.clone()), embed(x))[1]
    draft.train()
    with torch.no_grad():
        steps = [lg for _, lg in draft.ttt_steps(ids, taps)]
    t = ids.shape[1]
    for k in (1, 2):
        n = t - 1 - k
        guess = draft.draft_target_ids()[steps[k - 1].argmax(-1)]
        assert torch.equal(seen[k][:, :n], guess[:, :n])
        assert not torch.equal(seen[k][:, :n], ids[:, 1 + k :])
    assert torch.equal(seen[0][:, : t - 1], ids[:, 1:])  # step 0 always reads the data
    seen.clear()
    draft.eval()
    with torch.no_grad():
        list(draft.ttt_steps(ids, taps))
    assert torch.equal(seen[1][:, : t - 2], ids[:, 2:])


def test_label_temperature_sharpens_the_loss_labels_not_the_metrics():
    """model.label_temperature < 1 trains against softmax(target logits / T) on the draft vocab, while the
    acceptance metrics keep the target's own distribution (T = 1)."""
    _, draft, ids, taps, final = _setup("llama", draft_vocab_size=200, ttt_length=1)
    with torch.no_grad():
        loss1, m1 = draft.loss(_batch(ids, taps, final))
        draft.model_cfg.label_temperature = 0.5
        loss05, m05 = draft.loss(_batch(ids, taps, final))
        step0 = next(iter(draft.ttt_steps(ids, taps)))[1]
        t = ids.shape[1]
        sub = (final @ draft.target_lm_head.T)[:, 1 : t - 1][..., draft.draft_target_ids()]
        expected = -(torch.softmax(sub / 0.5, -1) * torch.log_softmax(step0[:, : t - 2], -1)).sum(-1).mean()
    torch.testing.assert_close(loss05, expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(loss1, loss05)
    torch.testing.assert_close(m1["alpha_tf@1"][0], m05["alpha_tf@1"][0])
    with pytest.raises(ConfigError, match="label_temperature"):
        ModelConfig(label_temperature=0.0).validate()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_init_from_target_layer_starts_as_the_next_target_layer(family, tmp_path):
    """model.init_from_target_layer=k with fc passing the deepest tap (layer k-1) through: before any
    training, step 0's pre-norm output at row r equals the target's own layer-k output at position r
    (HF hidden_states[k+1]), whatever the token half reads; the weights come from the saved checkpoint."""
    from deepspec.train.build import load_target_layer

    torch.manual_seed(0)
    model, _ = tiny_target(family)
    model.save_pretrained(tmp_path)
    cfg = ModelConfig(algorithm="eagle3", target_layer_ids=[0, 1, 3], ttt_length=2, fc_norm=False, norm_output=False,
                      init_from_target_layer=4)
    draft = get_algorithm("eagle3").from_target_config(model.config, cfg)
    draft.load_target_weights(*target_weights(model))
    draft.init_from_target_layers([load_target_layer(str(tmp_path), 4)])
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        taps, _ = capture(model, ids, draft.taps)
        want = model(ids, output_hidden_states=True).hidden_states[5]
        hidden = draft.combine_taps(taps)
        t = ids.shape[1]
        pos = torch.arange(t).unsqueeze(0).expand(2, t)
        mask = causal_mask(torch.arange(t), torch.arange(t))[None, None]
        _, out, _ = draft.step(draft.embed(ids), hidden, pos, None, mask)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ConfigError, match="was not found"):
        load_target_layer(str(tmp_path), 99)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_init_copy_heads_copies_a_repeated_span_before_any_training(family):
    """The written-in induction heads: on a span seen before, row t (input token x_{t+1}) predicts the token
    that followed x_{t+1} the first time, with no training; random init does not. Qwen3 checks the q/k-norm path
    (tied here: a tiny random untied head has rows unrelated to its embeddings, which no 32-wide value can map)."""
    torch.manual_seed(0)
    model, _ = tiny_target(family, tie_word_embeddings=True)
    span = torch.randperm(250, generator=torch.Generator().manual_seed(3))[:24]
    ids = torch.cat([span, span])[None]

    def copy_accuracy(init: bool) -> float:
        cfg = ModelConfig(algorithm="eagle3", ttt_length=1, target_layer_ids=[-1, 2, 4], init_copy_heads=init)
        torch.manual_seed(0)
        draft = get_algorithm("eagle3").from_target_config(model.config, cfg)
        draft.load_target_weights(*target_weights(model))
        if init:
            draft.init_copy_heads()
        taps, _ = capture(model, ids, draft.taps)
        with torch.no_grad():
            (_, logits), = list(draft.ttt_steps(ids, taps))
        pred = draft.draft_target_ids()[logits[0].argmax(-1)]
        rows = torch.arange(24, 46)  # second copy: row t predicts x_{t+2}, which the span already showed
        return float((pred[rows] == ids[0, rows + 2]).float().mean())

    assert copy_accuracy(True) >= 0.5
    assert copy_accuracy(False) < 0.2


def test_init_copy_heads_needs_the_embeddings_tap():
    _, draft, *_ = _setup("llama", init_copy_heads=True)
    with pytest.raises(ConfigError, match="-1"):
        draft.init_copy_heads()
