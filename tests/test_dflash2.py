"""DFlash2 (deepspec/drafts/dflash2.py) against a dense reference written here from vLLM's DFlash2 description: one
block at a time, the block convolutions as explicit loops over slots and taps, attention as a plain softmax over the
context keys before the anchor and the block's own keys, the selector's pair term per prediction. Forward and loss,
padded and packed batches; the identity start equals DFlash; the proposer's candidate walk; refusals."""

from __future__ import annotations

import math

import pytest
import torch

from deepspec.config.model import ModelConfig
from deepspec.drafts import get_algorithm
from deepspec.drafts.checkpoint import target_weights
from deepspec.errors import ConfigError
from deepspec.targets import capture, tiny_target
from deepspec.data.batches import collate_features, pack_batch, pack_layout

LENGTHS = [11, 17, 9]
ANCHORS = [[2, 5, 8], [3, 9, 13], [4, 6, 0]]
KEEP = [[True, True, True], [True, True, True], [True, True, False]]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    yield


def _draft(live: bool = True, algorithm: str = "dflash2", **kw):
    torch.manual_seed(0)
    model, _ = tiny_target("qwen3")
    kw = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5, **kw}
    cfg = ModelConfig(algorithm=algorithm, target_layer_ids=[0, 2, 4], block_size=4, num_anchors=3, num_draft_layers=2, **kw)
    d = get_algorithm(algorithm).from_target_config(model.config, cfg)
    d.load_target_weights(*target_weights(model))
    if live:  # every DFlash2 part away from its identity start, so each one shapes the output
        with torch.no_grad():
            for name, p in d.named_parameters():
                if "conv" in name or "candidate_selector" in name:
                    p.add_(torch.randn_like(p) * (0.3 if "base_kernel" in name or "codebook" in name else 0.05))
    return model, d


def _items(model, taps_ids):
    g = torch.Generator().manual_seed(3)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(0, 250, (1, n), generator=g)
        taps, final = capture(model, ids, taps_ids)
        lm = torch.ones(n, dtype=torch.bool)
        lm[: 1 + i] = False
        lm[n - 2] = i != 1  # a hole in the second sample's answer: its prefix masks stop there
        out.append({"input_ids": ids[0], "loss_mask": lm, "taps": taps[0], "final_hidden": final[0]})
    return out


# --- the dense reference ---------------------------------------------------------------------------------------------

def _ref_conv(x, conv, side, coef_src):
    """x [K, H]: slot s = sum over t <= s of (base_kernel[side, t] + kernel_projection(coef_src)[s, side, t, group]) * x[s - t]."""
    k_n, h = x.shape
    c = conv.kernel_projection(coef_src).view(k_n, 2, conv.taps, conv.groups)
    out = torch.zeros_like(x)
    for s in range(k_n):
        for t in range(min(conv.taps, s + 1)):
            out[s] += (conv.base_kernel[side, t] + c[s, side, t].repeat_interleave(h // conv.groups)) * x[s - t]
    return out


def _ref_attention(attn, rotary, u, ctx, a):
    """Plain softmax attention of the block's K queries over the context rows 0..a-1 and the block's own K rows."""
    k_n = u.shape[0]
    cos_b, sin_b = rotary(torch.arange(a, a + k_n)[None], u.dtype)
    q = attn.project_q(u[None], cos_b, sin_b)
    kb, vb = attn.project_kv(u[None], cos_b, sin_b)
    cos_c, sin_c = rotary(torch.arange(a)[None], u.dtype)
    kc, vc = attn.project_kv(ctx[None], cos_c, sin_c)
    k, v = torch.cat([kc, kb], 2), torch.cat([vc, vb], 2)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return attn.output(w @ v)[0]


def _ref_block(d, ids, taps, a):
    """Final-normed hidden states [K, H] of the block of anchor a (one sample, unbatched)."""
    k_n = d.block_size
    ctx = d.hidden_norm(d.fc(taps[:a].flatten(-2)))
    x = d.embed(torch.tensor([int(ids[a])] + [d.mask_token_id] * (k_n - 1)))
    for layer in d.layers:
        n = layer.input_layernorm(x)
        o = _ref_attention(layer.self_attn, d.rotary, _ref_conv(n, layer.attention_conv, 0, n), ctx, a)
        x = x + _ref_conv(o, layer.attention_conv, 1, n)
        n = layer.post_attention_layernorm(x)
        x = x + _ref_conv(layer.mlp(_ref_conv(n, layer.mlp_conv, 0, n)), layer.mlp_conv, 1, n)
    return d.norm(x)


def _ref_loss(d, items, anchors, keep):
    """Position-decayed CE of every supervised prediction (slot 1 + p predicts token a + 1 + p, supervised while the
    labels a+1..a+1+p are all loss-masked), logits = LM head + the selector's pair term of token a + p."""
    sel, head = d.candidate_selector, d.target_lm_head
    num, den = 0.0, 0.0
    for item, anc, kp in zip(items, anchors, keep):
        ids, lm, n = item["input_ids"], item["loss_mask"], item["input_ids"].numel()
        for a, k in zip(anc, kp):
            if not k:
                continue
            h = _ref_block(d, ids, item["taps"], a)
            for p in range(d.block_size - 1):
                if a + 1 + p >= n or not lm[a + 1 + p]:
                    break
                prev = ids[a + p]
                z = sel.predecessor_codebook[prev] * sel.hidden_projection(h[1 + p])
                logits = h[1 + p] @ head.T + z @ sel.successor_codebook.T
                w = math.exp(-p / d.model_cfg.loss_decay_gamma)
                num = num + w * -torch.log_softmax(logits, -1)[ids[a + 1 + p]]
                den += w
    return num / den


def _packed_anchors():
    """ANCHORS shifted to the rows pack_batch(…, 24) puts their samples in, sorted, dummies last."""
    rows_a, rows_k = [], []
    for row in pack_layout(LENGTHS, 24):
        at, a, k = 0, [], []
        for i in row:
            a += [at + x for x in ANCHORS[i]]
            k += KEEP[i]
            at += LENGTHS[i]
        rows_a.append(a), rows_k.append(k)
    width = max(len(a) for a in rows_a)
    anchors = torch.tensor([a + [0] * (width - len(a)) for a in rows_a])
    keep = torch.tensor([k + [False] * (width - len(k)) for k in rows_k])
    order = anchors.masked_fill(~keep, 10**6).argsort(1)
    return anchors.gather(1, order), keep.gather(1, order)


# --- tests -----------------------------------------------------------------------------------------------------------

def test_forward_and_loss_equal_the_dense_reference_padded_and_packed():
    model, d = _draft()
    d.train()
    items = _items(model, d.taps)
    padded = collate_features(items)
    anchors, keep = torch.tensor(ANCHORS), torch.tensor(KEEP)
    with torch.no_grad():
        h = d.block_hidden(padded, anchors, keep)
        for i, item in enumerate(items):
            for j, a in enumerate(ANCHORS[i]):
                if KEEP[i][j]:
                    torch.testing.assert_close(h[i, j], _ref_block(d, item["input_ids"], item["taps"], a), atol=1e-5, rtol=1e-4)
    ref = _ref_loss(d, items, ANCHORS, KEEP)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    assert any("attention_conv.kernel_projection" in n for n in ref_grads) and "candidate_selector.successor_codebook" in ref_grads
    packed = pack_batch(padded, pack_tokens=24)
    assert packed.segment_ids is not None and packed.input_ids.shape[0] < len(items)
    for batch, (anc, kp) in ((padded, (anchors, keep)), (packed, _packed_anchors())):
        d.zero_grad()
        loss, metrics = d.loss(batch, anc, kp)
        loss.backward()
        torch.testing.assert_close(loss, ref.detach(), atol=1e-6, rtol=1e-5)
        for n, g in ref_grads.items():
            torch.testing.assert_close(dict(d.named_parameters())[n].grad, g, atol=1e-6, rtol=1e-4, msg=n)
        assert float(metrics["alpha_tf@1"][1]) == 8  # 8 kept anchors whose first label is supervised


def test_identity_start_is_dflash():
    """Freshly built, every conv is the identity and the pair term is 0: DFlash's hidden states and loss exactly."""
    model, d2 = _draft(live=False)
    _, d1 = _draft(live=False, algorithm="dflash")
    missing, unexpected = d1.load_state_dict(d2.state_dict(), strict=False)
    assert not missing and all("conv" in n or "candidate_selector" in n for n in unexpected) and unexpected
    items = _items(model, d2.taps)
    batch = collate_features(items)
    anchors, keep = torch.tensor(ANCHORS), torch.tensor(KEEP)
    l1, _ = d1.loss(batch, anchors, keep)
    l2, _ = d2.loss(batch, anchors, keep)
    torch.testing.assert_close(l2, l1, atol=0, rtol=1e-6)
    _, live = _draft()  # and the live parts do change it
    assert abs(float(live.loss(batch, anchors, keep)[0].detach()) - float(l1.detach())) > 1e-3


def test_proposer_walks_the_candidates_as_vllm_does():
    model, d = _draft()
    d.eval()
    items = _items(model, d.taps)
    ids, taps = items[1]["input_ids"], items[1]["taps"]
    prop = d.proposer()
    toks, probs = prop.propose(ids[:10], taps[:9], 0, 3)
    with torch.no_grad():
        h = _ref_block(d, ids, taps, 9)[1:]
        torch.testing.assert_close(prop.last_hidden, h, atol=1e-5, rtol=1e-4)
        sel, prev, want = d.candidate_selector, int(ids[9]), []
        for p in range(3):  # top-k of the LM head, rescored with the pair term of the token drawn before, greedy
            unary = h[p] @ d.target_lm_head.T
            cands = unary.topk(sel.top_k).indices
            scores = unary[cands] + (sel.predecessor_codebook[prev] * sel.hidden_projection(h[p])) @ sel.successor_codebook[cands].T
            prev = int(cands[scores.argmax()])
            want.append(prev)
    assert toks.tolist() == want
    assert (probs.sum(-1) == 1).all()
    # sampled: the distribution is the softmax of the scores over the k candidates only
    toks, probs = d.proposer().propose(ids[:10], taps[:9], 0, 3, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert ((probs > 0).sum(-1) == sel.top_k).all() and torch.allclose(probs.sum(-1), torch.ones(3))
    with torch.no_grad():
        unary = h[1] @ d.target_lm_head.T
        cands = unary.topk(sel.top_k).indices
        scores = unary[cands] + (sel.predecessor_codebook[int(toks[0])] * sel.hidden_projection(h[1])) @ sel.successor_codebook[cands].T
    torch.testing.assert_close(probs[1, cands], torch.softmax(scores, -1), atol=1e-6, rtol=1e-5)


def test_refusals():
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        _draft(draft_vocab_size=100)
    with pytest.raises(ConfigError, match="conv_group_size"):
        _draft(conv_group_size=24)


# --- trained and evaluated -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_qwen3_dir):
    """A DFlash2 draft trained for 4 steps on a tiny Qwen3 target's cache (the shared tiny recipe), its recipe."""
    from tiny_recipe import cached_recipe

    from deepspec.config import load_config
    from deepspec.train import train

    root = tmp_path_factory.mktemp("dflash2")
    recipe = cached_recipe(root, tiny_qwen3_dir, samples=8, heldout=2, max_length=96, project="d2",
                           model="algorithm: dflash2, block_size: 4, num_anchors: 8, conv_group_size: 16, selector_rank: 8, "
                                 "selector_top_k: 4",
                           train="optimizer: adamw, lr: 3.0e-3, global_batch_size: 2, micro_batch_size: 1, max_steps: 4, "
                                 "save_every: 4, val_every: 4, log_every: 1, precision: fp32")
    cfg = load_config(recipe)
    train(cfg)
    return root, cfg


def test_a_trained_dflash2_is_evaluated_per_depth(trained):
    """Training moves both DFlash2 parts off their identity start; the evaluator decodes with the candidate walk and
    reports per-depth acceptance for the block's K - 1 drafts, tau = 1 + the sum of the prefix survivals."""
    import json

    from deepspec.config import load_config
    from deepspec.drafts.checkpoint import load_draft
    from deepspec.eval.runner import evaluate

    root, cfg = trained
    ckpt = cfg.run_dir / "step_4"
    draft = load_draft(ckpt)
    assert draft.algorithm == "dflash2"
    assert float(draft.layers[0].attention_conv.kernel_projection.weight.detach().abs().max()) > 0
    assert float(draft.candidate_selector.successor_codebook.detach().abs().max()) > 0
    d = root / "ds"
    d.mkdir()
    (d / "gsm8k.jsonl").write_text("".join(json.dumps({"turns": [f"the cat sat on {w}"]}) + "\n" for w in ("a mat", "home")))
    out = root / "eval"
    res = evaluate(load_config(str(ckpt / "config.yaml"), [
        f"eval.datasets_dir={d}", "eval.tasks=[gsm8k]", "eval.max_new_tokens=12", "eval.num_draft_tokens=3",
        f"eval.output_dir={out}", "logging.wandb=false", "eval.measure_speedup=false", "eval.temperature=0.0"]), ckpt)
    task = res["tasks"]["gsm8k"]
    print(json.dumps(task)[:2000])
    assert json.loads((out / "results.json").read_text())["tasks"]["gsm8k"]["tau"] == task["tau"]
    survival = task["survival"]
    assert len(survival) == 3 and all(0.0 <= s <= 1.0 for s in survival)
    assert task["tau"] == pytest.approx(1 + sum(survival))
