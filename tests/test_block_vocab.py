"""Block drafts (DFlash, DSpark) with a draft vocabulary (model.draft_vocab_size): the head is the target's rows of
the most frequent ids, the loss runs over them, decoding maps draft ids back to target ids, checkpoints and vLLM
exports keep d2t and the head rows; without one (null or >= the target's vocabulary) nothing changes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from deepspec.config.model import ModelConfig
from deepspec.drafts import DraftBatch, get_algorithm
from deepspec.drafts.checkpoint import load_draft, save_draft, target_weights
from deepspec.errors import ConfigError
from deepspec.export.writers import export_draft
from deepspec.targets import capture, tiny_target

DV = 40  # of the tiny targets' 320 ids


def _counts(ids: torch.Tensor) -> torch.Tensor:
    """Token counts that put most of the data's ids in the top DV but every multiple of 7 last (labels outside)."""
    c = torch.bincount(ids.flatten(), minlength=320).float() + torch.linspace(0.5, 0.0, 320)
    c[::7] = -1.0
    return c


def _setup(algorithm: str, family: str = "qwen3", draft_vocab_size: int | None = DV, counts=True, **kw):
    torch.manual_seed(0)
    model, _ = tiny_target(family)
    kw.setdefault("target_layer_ids", [0, 2, 4])
    cfg = ModelConfig(algorithm=algorithm, block_size=4, num_anchors=3, markov_rank=8, draft_vocab_size=draft_vocab_size, **kw)
    torch.manual_seed(0)
    draft = get_algorithm(algorithm).from_target_config(model.config, cfg)
    draft.load_target_weights(*target_weights(model))
    if algorithm == "dspark":
        torch.nn.init.normal_(draft.markov_head.markov_w2.weight, std=0.5, generator=torch.Generator().manual_seed(5))
    ids = torch.randint(0, 60, (2, 18), generator=torch.Generator().manual_seed(1))
    if counts:
        draft.set_token_frequencies(_counts(ids))
    taps, final = capture(model, ids, draft.taps)
    return model, draft, ids, taps, final


def _batch(ids, taps, final):
    ones = torch.ones_like(ids, dtype=torch.bool)
    return DraftBatch(ids, ones, ones, taps, final)


ANCHORS = torch.tensor([[1, 5, 9], [2, 6, 12]])


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_full_vocabulary_is_unchanged(algorithm):
    """draft_vocab_size null and >= the target's vocabulary: the same modules, state, loss and gradients (the full
    frozen target head, no lm_head / d2t / t2d), pinned against the loss written out by hand."""
    outs = []
    for size in (None, 320, 10**6):
        _, d, ids, taps, final = _setup(algorithm, draft_vocab_size=size)
        assert d.draft_vocab_size == 320 and not d.reduced_vocab
        assert not {"lm_head.weight", "d2t", "t2d"} & set(d.state_dict())
        loss, m = d.loss(_batch(ids, taps, final), ANCHORS)
        loss.backward()
        outs.append((loss.detach(), m["ce_loss"][0], m["ce_loss"][1], m["expected_tau"][0], d.fc.weight.grad.clone()))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)
    if algorithm == "dflash":  # CE only: sum_rows w * -log softmax(h @ W_target^T)[label] / sum w
        _, d, ids, taps, final = _setup(algorithm, draft_vocab_size=None)
        keep = torch.ones_like(ANCHORS, dtype=torch.bool)
        with torch.no_grad():
            h = d.block_hidden(_batch(ids, taps, final), ANCHORS, keep)[:, :, d.first_slot :]
            labels, emask, _ = d.block_labels(ids, torch.ones_like(ids), torch.ones_like(ids), ANCHORS, keep)
            w = torch.exp(-torch.arange(d.num_predictions).float() / d.model_cfg.loss_decay_gamma) * emask
            ce = -torch.log_softmax(h @ d.target_lm_head.T, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(outs[0][0], (w * ce).sum() / w.sum(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_draft_vocabulary_from_frequencies_and_head_rows(algorithm):
    _, d, ids, _, _ = _setup(algorithm)
    top = torch.sort(torch.sort(-_counts(ids), stable=True).indices[:DV]).values
    assert d.draft_vocab_size == DV and torch.equal(d.draft_target_ids(), top) and int(d.t2d.sum()) == DV
    assert torch.equal(d.lm_head.weight, d.target_lm_head[top])
    assert not d.lm_head.weight.requires_grad  # frozen like the full target head
    if algorithm == "dspark":  # vLLM's sizes: w1 reads target ids, w2 biases the draft vocabulary
        assert d.markov_head.markov_w1.weight.shape == (320, 8) and d.markov_head.markov_w2.weight.shape == (DV, 8)


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_reduced_loss_equals_full_head_restricted_to_the_draft_vocabulary(algorithm):
    """Golden: the draft-vocabulary loss, metrics and gradients equal the full-vocabulary formulas with the logits
    restricted to the draft vocabulary's columns (CE only over labels inside it; L1 / alpha against the target's
    full distribution, the draft being zero outside its vocabulary)."""
    _, d, ids, taps, final = _setup(algorithm)
    tids = d.draft_target_ids()
    batch = _batch(ids, taps, final)
    loss, m = d.loss(batch, ANCHORS)
    loss.backward()
    got_grad = d.fc.weight.grad.clone()
    d.zero_grad()

    keep = torch.ones_like(ANCHORS, dtype=torch.bool)
    b, na, p_n = 2, 3, d.num_predictions
    h = d.block_hidden(batch, ANCHORS, keep)[:, :, d.first_slot :]
    labels, emask, lp = d.block_labels(ids, torch.ones_like(ids), torch.ones_like(ids), ANCHORS, keep)
    logits = (h @ d.target_lm_head.T)[..., tids]  # the full head, restricted to the draft vocabulary's columns
    if algorithm == "dspark":
        prev = ids.gather(1, (lp - 1).view(b, -1)).view(b, na, p_n)
        z = d.markov_head.features(h.reshape(b * na, p_n, -1), prev.reshape(b * na, p_n)).view(b, na, p_n, -1)
        logits = logits + d.markov_head.markov_w2(z)
    logp = torch.log_softmax(logits, -1)
    inside = d.t2d[labels]
    assert inside.any() and not inside.all()  # both kinds of labels occur
    draft_label = torch.searchsorted(tids, labels).clamp(max=DV - 1)
    ce = -logp.gather(-1, draft_label.unsqueeze(-1)).squeeze(-1)
    w = torch.exp(-torch.arange(p_n).float() / d.model_cfg.loss_decay_gamma) * emask
    w_ce = w * inside
    ce_loss = (w_ce * ce).sum() / w_ce.sum()
    p_t = torch.softmax(final @ d.target_lm_head.T, -1).gather(1, (lp - 1).view(b, -1, 1).expand(-1, -1, 320)).view(b, na, p_n, -1)
    p_d = torch.zeros_like(p_t)
    p_d[..., tids] = logp.exp()
    l1 = (p_d - p_t).abs().sum(-1)
    alpha = torch.minimum(p_d, p_t).sum(-1)
    if algorithm == "dflash":
        want = ce_loss
    else:
        want = 0.1 * ce_loss + 0.9 * (w * l1).sum() / w.sum() + float(m["confidence_loss"][0] / m["confidence_loss"][1])
    torch.testing.assert_close(loss.detach(), want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m["ce_loss"][1], w_ce.sum())
    torch.testing.assert_close(m["alpha_tf@1"][0], (alpha[..., 0] * emask[..., 0]).sum().detach(), atol=1e-5, rtol=1e-5)
    top = (tids[logits.argmax(-1)] == p_t.argmax(-1)).float()
    torch.testing.assert_close(m["top1@2"][0], (top[..., 1] * emask[..., 1]).sum())
    if algorithm == "dflash":
        ce_loss.backward()
        torch.testing.assert_close(got_grad, d.fc.weight.grad, atol=1e-6, rtol=1e-4)
        assert d.lm_head.weight.grad is None


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_proposer_draws_target_ids_of_the_draft_vocabulary_as_trained(algorithm):
    """Decoding = training: the proposer's block is the training block of the same anchor, its greedy tokens are
    the draft vocabulary's argmax mapped to target ids, and sampled distributions live on the draft vocabulary."""
    _, d, ids, taps, final = _setup(algorithm)
    tids = d.draft_target_ids()
    anchors = torch.tensor([[4, 9, 13]])
    with torch.no_grad():
        train_h = d.block_hidden(_batch(ids[:1], taps[:1], final[:1]), anchors, torch.ones(1, 3, dtype=torch.bool))
    prop = d.proposer()
    toks, probs = prop.propose(ids[0, :10], taps[0, :9], 0, d.num_predictions)
    torch.testing.assert_close(prop.last_hidden, train_h[0, 1, d.first_slot :], atol=1e-5, rtol=1e-4)
    assert d.t2d[toks].all() and probs.shape == (d.num_predictions, 320)
    with torch.no_grad():
        base = prop.last_hidden @ d.lm_head.weight.T
        if algorithm == "dflash":
            assert toks.tolist() == tids[base.argmax(-1)].tolist()
        else:  # each slot's bias reads the token drafted before it (a target id)
            prev = torch.cat([ids[0, 9:10], toks[:-1]])
            z = d.markov_head.features(prop.last_hidden.unsqueeze(0), prev.unsqueeze(0))[0]
            assert toks.tolist() == tids[(base + d.markov_head.markov_w2(z)).argmax(-1)].tolist()
    toks, probs = d.proposer().propose(ids[0, :10], taps[0, :9], 0, 3, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert d.t2d[toks].all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(toks)))
    assert float(probs[:, ~d.t2d].abs().sum()) == 0.0


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_checkpoint_and_vllm_export_keep_the_draft_vocabulary(algorithm, tmp_path):
    _, d, _, _, _ = _setup(algorithm, family="qwen3")
    prov = {"target": "tiny-qwen3", "target_vocab_size": 320, "target_hidden_size": 64, "target_num_layers": 6}
    ckpt = save_draft(d, tmp_path / "ckpt", prov)
    back = load_draft(ckpt)  # no target: the head rows come from the checkpoint
    for name in ("d2t", "t2d", "lm_head.weight"):
        assert torch.equal(back.state_dict()[name], d.state_dict()[name])
    assert back.draft_vocab_size == DV
    out = export_draft(ckpt, tmp_path / "out", "vllm", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    assert cfg["draft_vocab_size"] == DV
    assert torch.equal(w["d2t"], d.d2t) and torch.equal(w["lm_head.weight"], d.target_lm_head[d.d2t + torch.arange(DV)])
    if algorithm == "dspark":
        assert w["markov_head.markov_w2.weight"].shape == (DV, 8)
        pytest.importorskip("vllm")
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

        assert SpeculatorsConfig.from_pretrained(str(out)).draft_vocab_size == DV
    else:
        assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["vocab_size"] == 320
    with pytest.raises(ConfigError, match="draft vocabulary"):
        export_draft(ckpt, tmp_path / "sg", "sglang")


def test_full_vocabulary_block_exports_share_the_target_head(tmp_path):
    _, d, _, _, _ = _setup("dflash", draft_vocab_size=None)
    ckpt = save_draft(d, tmp_path / "ckpt", {"target": "tiny-qwen3", "target_vocab_size": 320})
    out = export_draft(ckpt, tmp_path / "out", "vllm")
    w = load_file(str(out / "model.safetensors"))
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 320
    assert not {"lm_head.weight", "d2t", "t2d"} & set(w)


def test_chunk_terms_tv_identity_on_the_draft_vocabulary():
    """With the draft zero outside its vocabulary, alpha = 1 - L1 / 2 still holds row by row (DSpark's confidence target)."""
    _, d, ids, taps, final = _setup("dflash")
    h = torch.randn(5, 64)
    ce, l1, alpha, _ = d._chunk_terms(h, final[0, :5], torch.zeros(5, dtype=torch.long), tids=d.draft_target_ids())
    torch.testing.assert_close(alpha, 1 - 0.5 * l1, atol=1e-6, rtol=1e-5)
    assert (alpha < 1).all()  # target mass outside the draft vocabulary is never accepted


def test_invalid_draft_vocab_size_is_refused():
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        _setup("dflash", draft_vocab_size=-3)


def test_full_vocabulary_checkpoint_with_a_recorded_draft_vocab_size_still_loads(tmp_path):
    """A block draft saved while model.draft_vocab_size was ignored scored the full vocabulary: it reloads as that."""
    _, d, _, _, _ = _setup("dflash", draft_vocab_size=None)
    ckpt = save_draft(d, tmp_path / "ckpt", {"target": "tiny-qwen3"})
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["deepspec"]["model"]["draft_vocab_size"] = DV
    (ckpt / "config.json").write_text(json.dumps(cfg))
    back = load_draft(ckpt)
    assert not back.reduced_vocab and torch.equal(back.fc.weight, d.fc.weight)
