"""The mask-free draft attention and the chunked losses equal the dense-mask / full-vocabulary references
(fp32, tight tolerance), values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from deepspec.config.model import ModelConfig
from deepspec.drafts import DraftBatch, get_algorithm
from deepspec.drafts.attention import (
    block_attention,
    chain_attention,
    dense_block_reference,
    dense_chain_reference,
    sample_ranges,
)
from deepspec.drafts.checkpoint import target_weights
from deepspec.drafts.layers import causal_mask
from deepspec.targets import capture, tiny_target

TOL = dict(rtol=1e-5, atol=1e-5)


def _close(a: torch.Tensor, b: torch.Tensor, name: str = "") -> None:
    """Whole-draft gradients: equal to 1e-5 of the tensor's scale (fp32 sums in another order)."""
    err, scale = float((a - b).abs().max()), float(b.abs().max())
    assert err <= 1e-5 * scale + 1e-6, f"{name}: max error {err} at scale {scale}"


def _grads(out, inputs, keep=None):
    w = torch.randn(out.shape, dtype=out.dtype)  # by shape, not randn_like: the same weights whatever the layout
    if keep is not None:
        w = w * keep
    return torch.autograd.grad((out * w).sum(), inputs)


@pytest.mark.parametrize("sentinel", [False, True])  # steps >= 1: merged through the flash kernel's lse / a sentinel
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("step", [0, 1, 3, 6])
def test_chain_attention_equals_dense_reference(packed, window, step, sentinel):
    _check_chain(step, packed, window, sentinel)


def _check_chain(step: int, packed: bool, window: int | None, sentinel: bool, parts=None) -> None:
    """chain_attention (through `parts`, else eager) equals the dense [T, (k+1)T] mask's attention, values and
    gradients, on the real rows."""
    torch.manual_seed(step)
    b, h, hk, t, d = 2, 6, 2, 29, 8  # GQA: 3 query heads per KV head
    q = torch.randn(b, h, t, d, requires_grad=True)
    k0 = torch.randn(b, hk, t, d, requires_grad=True)
    v0 = torch.randn(b, hk, t, d, requires_grad=True)
    diag = [(torch.randn(b, hk, t, d, requires_grad=True), torch.randn(b, hk, t, d, requires_grad=True)) for _ in range(step)]
    seg = torch.tensor([[0] * 9 + [1] * 14 + [2] * 3 + [-1] * 3, [0] * 20 + [1] * 9]) if packed else None
    out = chain_attention(q, k0, v0, diag, sample_ranges(seg, b, t), window, parts=parts, sentinel=sentinel)
    ref = dense_chain_reference(q, k0, v0, diag, seg, window)
    real = (torch.ones(b, t, dtype=torch.bool) if seg is None else seg >= 0)[:, None, :, None].float()
    torch.testing.assert_close(out * real, ref * real, **TOL)
    inputs = [q, k0, v0] + [x for kv in diag for x in kv]
    torch.manual_seed(99)
    g_new = _grads(out, inputs, real)
    torch.manual_seed(99)
    g_ref = _grads(ref, inputs, real)
    for a, r in zip(g_new, g_ref):
        torch.testing.assert_close(a, r, **TOL)


@pytest.fixture(scope="module")
def compiled_chain():
    """One compiled ChainParts for the module's tests (its graphs shared: k = 1 specialised, later steps dynamic)."""
    from deepspec.drafts.attention import ChainParts
    from deepspec.train.compile import compile_draft

    parts = ChainParts()
    assert compile_draft(parts, True)
    return parts


@pytest.mark.slow
@pytest.mark.parametrize("sentinel", [False, True])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("step", [1, 3, 6])
def test_compiled_chain_parts_equal_the_dense_reference(compiled_chain, window, step, sentinel):
    """train.compile's ChainParts (the diagonal and its backward with their products as fused fp32 reductions, both
    merges): the dense reference's values and gradients on packed rows, with the window biting from step 4 on."""
    from deepspec.train.compile import compiled_regions

    assert {r.name for r in compiled_regions(compiled_chain)} == {"diagonal", "diagonal_backward", "merge", "merge_lse"}
    _check_chain(step, True, window, sentinel, parts=compiled_chain)


def test_the_sentinel_switch_turns_the_flash_lse_merge_off(monkeypatch):
    """DEEPSPEC_CHAIN_SENTINEL=1 sends TTT steps >= 1 to the sentinel call (the same values): the A/B switch, and the way
    back on a GPU where the flash kernel's log-sum-exp path fails."""
    import deepspec.drafts.attention as attention

    calls = []
    real = attention._causal_lse
    monkeypatch.setattr(attention, "_causal_lse", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    q, k0, v0 = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    diag = [(torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8))]
    r = sample_ranges(None, 1, 20)
    merged = chain_attention(q, k0, v0, diag, r)
    assert calls == [1]
    monkeypatch.setenv("DEEPSPEC_CHAIN_SENTINEL", "1")
    torch.testing.assert_close(chain_attention(q, k0, v0, diag, r), merged, **TOL)
    assert calls == [1]


def test_window_bites_in_the_chain():
    torch.manual_seed(0)
    q, k0, v0 = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    r = sample_ranges(None, 1, 20)
    full = chain_attention(q, k0, v0, [], r, None)
    assert not torch.allclose(chain_attention(q, k0, v0, [], r, 5), full)
    torch.testing.assert_close(chain_attention(q, k0, v0, [], r, 20), full)


@pytest.mark.parametrize("window", [None, 3, 6])
def test_block_attention_equals_dense_reference(window):
    torch.manual_seed(1)
    b, h, hk, d, a, k, s = 2, 4, 2, 8, 5, 4, 30
    q = torch.randn(b, h, a * k, d, requires_grad=True)
    kb, vb = torch.randn(b, hk, a * k, d, requires_grad=True), torch.randn(b, hk, a * k, d, requires_grad=True)
    kc, vc = torch.randn(b, hk, s, d, requires_grad=True), torch.randn(b, hk, s, d, requires_grad=True)
    anchors = torch.tensor([[0, 3, 10, 20, 25], [1, 2, 5, 9, 28]])
    start = torch.tensor([[0, 0, 0, 15, 15], [0, 0, 0, 0, 0]])  # row 0: a second packed sample from 15
    keep = torch.tensor([[True, True, True, True, False], [True] * 5])
    valid = torch.ones(b, s, dtype=torch.bool)
    out = block_attention(q, kb, vb, kc, vc, anchors, start, keep, valid, window)
    ref = dense_block_reference(q, kb, vb, kc, vc, anchors, start, keep, valid, window)
    torch.testing.assert_close(out, ref, **TOL)
    inputs = [q, kb, vb, kc, vc]
    torch.manual_seed(7)
    g_new = _grads(out, inputs)
    torch.manual_seed(7)
    g_ref = _grads(ref, inputs)
    for x, y in zip(g_new, g_ref):
        torch.testing.assert_close(x, y, **TOL)


# --- whole drafts against the previous (dense-mask, full-vocabulary) implementation -------------------------
def _eagle3(**kw):
    torch.manual_seed(0)
    model, _ = tiny_target("llama")
    cfg = ModelConfig(algorithm="eagle3", target_layer_ids=[0, 2, 4], ttt_length=kw.pop("ttt_length", 4), **kw)
    draft = get_algorithm("eagle3").from_target_config(model.config, cfg)
    draft.load_target_weights(*target_weights(model))
    for p in draft.parameters():
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    ids = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(1))
    taps, final = capture(model, ids, draft.taps)
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[:, :4] = False
    lm[1, 12:] = False
    return draft, DraftBatch(ids, lm, torch.ones_like(lm), taps, final)


def _eagle3_reference_loss(draft, batch):
    """EAGLE-3's loss as it was computed before: [T, (k+1)T] masks and [T, V] fp32 log-softmax."""
    ids, lm, am = batch.input_ids, batch.loss_mask, batch.attention_mask
    b, t = ids.shape
    cfg = draft.model_cfg
    tids = draft.draft_target_ids()
    p_sub = torch.softmax(draft.target_logits(batch.final_hidden, rows=tids) / cfg.label_temperature, dim=-1)
    hidden = draft.combine_taps(batch.taps)
    pos = torch.arange(t).unsqueeze(0).expand(b, t)
    base, eye = causal_mask(torch.arange(t), torch.arange(t)), torch.eye(t, dtype=torch.bool)
    past, total = None, torch.zeros(())
    for k in range(cfg.ttt_length):
        n = t - 1 - k
        shifted = torch.zeros_like(ids)
        shifted[:, :n] = ids[:, 1 + k :]
        mask = torch.cat([base] + [eye] * k, dim=1)[None, None]
        logits, hidden, kv, normed = draft._step(draft.embed(shifted), hidden, pos + k, past, mask)
        past = kv if past is None else [(torch.cat([p[0], x[0]], 2), torch.cat([p[1], x[1]], 2)) for p, x in zip(past, kv)]
        m = n - 1
        v = (lm[:, 2 + k :] & am[:, 2 + k :]).float()
        ce = -(p_sub[:, 1 + k : 1 + k + m] * torch.log_softmax(logits[:, :m].float(), -1)).sum(-1)
        step = (ce * v).sum() / v.sum().clamp(min=1)
        if cfg.hidden_loss_weight:
            diff = normed[:, :m] - batch.final_hidden[:, 1 + k : 1 + k + m]
            hl = torch.nn.functional.smooth_l1_loss(diff, torch.zeros_like(diff), reduction="none").mean(-1)
            step = step + cfg.hidden_loss_weight * (hl * v).sum() / v.sum().clamp(min=1)
        total = total + cfg.step_loss_decay**k * step
    return total


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"draft_vocab_size": 120, "label_temperature": 0.5, "vocab_chunk_rows": 7},
        {"num_draft_layers": 2, "hidden_loss_weight": 0.3, "vocab_chunk_rows": 5, "logit_softcap": 20.0},
    ],
)
@pytest.mark.parametrize("logged", [True, False], ids=["labels-from-full-head", "labels-from-draft-rows"])
def test_eagle3_loss_and_grads_equal_the_dense_full_vocab_reference(kw, logged):
    draft, batch = _eagle3(**kw)
    draft.train()
    draft.train_metrics = logged  # logged steps take the labels from the full-vocabulary metrics pass
    loss, metrics = draft.loss(batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    ref = _eagle3_reference_loss(draft, batch)
    ref.backward()
    torch.testing.assert_close(loss, ref, **TOL)
    assert grads
    for n, p in draft.named_parameters():
        if p.grad is not None:
            _close(grads[n], p.grad, n)
    assert float(metrics["_loss_weight"][0]) == float((batch.loss_mask[:, 2:]).sum())


@pytest.mark.slow
def test_eagle3_activation_checkpointing_changes_nothing():
    out = []
    for ckpt in (False, True):
        draft, batch = _eagle3(num_draft_layers=2, activation_checkpointing=ckpt)
        draft.train()
        loss, _ = draft.loss(batch)
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in draft.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(out[0][0], out[1][0], **TOL)
    for n in out[0][1]:
        _close(out[0][1][n], out[1][1][n], n)


def _block(algorithm, **kw):
    torch.manual_seed(0)
    model, _ = tiny_target("qwen3")
    cfg = ModelConfig(algorithm=algorithm, target_layer_ids=[0, 2, 4], block_size=4, num_anchors=4, markov_rank=8, **kw)
    draft = get_algorithm(algorithm).from_target_config(model.config, cfg)
    draft.load_target_weights(*target_weights(model))
    ids = torch.randint(0, 250, (2, 18), generator=torch.Generator().manual_seed(1))
    taps, final = capture(model, ids, draft.taps)
    ones = torch.ones_like(ids, dtype=torch.bool)
    return draft, DraftBatch(ids, ones, ones, taps, final)


@pytest.mark.parametrize("ckpt", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_block_hidden_and_grads_equal_the_dense_mask_reference(algorithm, ckpt):
    """With activation checkpointing the layers and, inside them, every attention chunk are rebuilt in backward."""
    draft, batch = _block(algorithm, num_draft_layers=2, activation_checkpointing=ckpt)
    draft.train()
    anchors = torch.tensor([[0, 3, 7, 12], [2, 5, 9, 0]])
    keep = torch.tensor([[True, True, True, True], [True, True, True, False]])
    h = draft.block_hidden(batch, anchors, keep)
    g = torch.randn_like(h)
    (h * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    ids, pos, mask = draft.block_inputs(batch.input_ids, anchors, keep, batch.attention_mask)
    ctx = draft.context(batch.taps)
    t = batch.input_ids.shape[1]
    ref = draft.backbone(draft.embed(ids), pos, draft.context_kv(ctx, torch.arange(t).unsqueeze(0).expand(2, t)), mask)
    ref = ref.view_as(h)
    (ref * g).sum().backward()
    torch.testing.assert_close(h, ref, **TOL)
    for n, p in draft.named_parameters():
        if p.grad is not None:
            _close(grads[n], p.grad, n)


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_block_loss_weight_and_reproducible_validation_anchors(algorithm):
    draft, batch = _block(algorithm)
    draft.eval()
    with torch.no_grad():
        a1 = draft.sample_anchors(batch.loss_mask, batch.attention_mask)
        a2 = draft.sample_anchors(batch.loss_mask, batch.attention_mask)
        m1 = draft.loss(batch)[1]
        m2 = draft.loss(batch)[1]
    assert torch.equal(a1[0], a2[0]) and torch.equal(a1[1], a2[1])
    assert float(m1["expected_tau"][0]) == float(m2["expected_tau"][0])
    # the weight is the sum of the supervised prediction weights (what the loss is a mean over)
    assert float(m1["_loss_weight"][0]) == pytest.approx(float(m1["ce_loss"][1]))
    draft.train()
    with torch.no_grad():
        draws = {tuple(draft.sample_anchors(batch.loss_mask, batch.attention_mask)[0].flatten().tolist()) for _ in range(4)}
    assert len(draws) > 1  # training keeps drawing fresh anchors


def test_chain_attention_bf16_error_stays_near_the_dense_kernels():
    """In bf16 the merge weight travels through a bf16 query channel and the two parts are rounded separately: the
    error stays close to a dense bf16 kernel's (measured: mean 1.15x, max 1.1-1.8x over seeds)."""
    import torch

    from deepspec.drafts.attention import chain_attention, dense_chain_reference, sample_ranges

    torch.manual_seed(0)
    b, h, hk, t, d = 1, 8, 2, 256, 64
    q = torch.randn(b, h, t, d) * 3
    k0, v0 = torch.randn(b, hk, t, d), torch.randn(b, hk, t, d)
    diag = [(torch.randn(b, hk, t, d) * 1.5, torch.randn(b, hk, t, d)) for _ in range(3)]
    exact = dense_chain_reference(q, k0, v0, diag)
    bf = [x.bfloat16() for x in (q, k0, v0)]
    bdiag = [(a.bfloat16(), c.bfloat16()) for a, c in diag]
    new = chain_attention(*bf, bdiag, sample_ranges(None, b, t)).float()
    dense = dense_chain_reference(*bf, bdiag).float()
    assert (new - exact).abs().mean() < 1.3 * (dense - exact).abs().mean()
    assert (new - exact).abs().max() < 2.5 * (dense - exact).abs().max()


def test_the_merge_check_passes_the_cpu_kernel_and_catches_a_wrong_lse_or_backward(monkeypatch, caplog):
    """`merge_check` (run once per GPU, dtype and head dim before the chain takes the CUDA flash kernel's log-sum-exp),
    tried here on the CPU kernel: it passes in fp32, bf16 and fp16; a log-sum-exp off by the log2 / ln factor, or a
    backward that halves dv, is caught, named, logged once and remembered; FLOP counters and autocast around it
    see nothing of it."""
    import logging

    from deepspec.drafts import attention as att
    from deepspec.train.flops import count_flops

    monkeypatch.setattr(att, "_MERGE_CHECKS", {})
    cpu = torch.device("cpu")
    good = (att._cpu_flash_forward, att._cpu_flash_backward)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert att.merge_check(good, cpu, dtype, 64) is None, dtype

    def log2_lse(q, k, v, scale):
        out, lse, state = att._cpu_flash_forward(q, k, v, scale)
        return out, lse / math.log(2), state

    def half_dv(grad, q, k, v, out, lse, extra, scale):
        dq, dk, dv = att._cpu_flash_backward(grad, q, k, v, out, lse, extra, scale)
        return dq, dk, dv / 2

    with caplog.at_level(logging.WARNING, logger="deepspec.drafts.attention"):
        wrong_lse = att.merge_check((log2_lse, good[1]), cpu, torch.bfloat16, 32)
        wrong_dv = att.merge_check((good[0], half_dv), cpu, torch.bfloat16, 48)
        assert att.merge_check((good[0], half_dv), cpu, torch.bfloat16, 48) == wrong_dv  # remembered, not rerun
    assert wrong_lse.startswith("output differs") and wrong_dv.startswith("dv0 differs"), (wrong_lse, wrong_dv)
    assert [r.getMessage().count("takes the sentinel call") for r in caplog.records] == [1, 1]
    assert att.merge_check_failure(cpu, torch.bfloat16, 48) == wrong_dv and att.merge_check_failure(cpu, torch.float32, 64) is None

    monkeypatch.setattr(att, "_MERGE_CHECKS", {})
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():  # a validation step's: the check runs outside
        count = count_flops(lambda: att.merge_check(good, cpu, torch.float32, 64))
    assert att.merge_check_failure(cpu, torch.float32, 64) is None
    assert count.total == 0 and not count.by_op, count.by_op  # the FLOP counter's mode was off during the check
    assert list(att._MERGE_CHECKS) == [("cpu", torch.float32, 64)]

    # first reached inside an activation checkpoint's forward (a layer under model.activation_checkpointing): the
    # check's own graph must not go through the checkpoint's hooks (it did, and failed the check with CheckpointError)
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(att, "_MERGE_CHECKS", {})
    seen = []

    def layer(x):
        seen.append(att.merge_check(good, cpu, torch.float32, 64))
        return x * x  # saves x: the backward recomputes the layer

    x = torch.randn(3, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert seen == [None, None] and torch.allclose(x.grad, 2 * x)  # forward and recompute, both passed


@pytest.mark.cuda(reason="the CUDA flash kernel's log-sum-exp and backward")
@pytest.mark.parametrize("d", [64, 128])
def test_on_cuda_the_chain_merged_through_the_flash_lse_equals_the_reference(d):
    """bf16 on CUDA, packed and bucketed rows, grouped-query heads, TTT step 3: the chain merged through the flash
    kernel's log-sum-exp (its backward handed the merged output) is as close to the exact attention of the same bf16
    inputs as the sentinel call is, values and gradients."""
    from deepspec.drafts.attention import flash_lse_ops, merge_check_failure

    torch.manual_seed(0)
    dev, b, h, hk, t = "cuda", 2, 8, 2, 301
    make = lambda *shape: (torch.randn(*shape, device=dev) * 2).bfloat16().requires_grad_()  # noqa: E731
    q, k0, v0 = make(b, h, t, d), make(b, hk, t, d), make(b, hk, t, d)
    diag = [(make(b, hk, t, d), make(b, hk, t, d)) for _ in range(3)]
    assert flash_lse_ops(q) is not None, merge_check_failure(q.device, q.dtype, d)  # its one-time check passed here
    seg = torch.zeros(b, t, dtype=torch.long, device=dev)
    seg[0, 120:] = 1
    seg[1, 280:] = -1
    real = (seg >= 0)[:, None, :, None].float()
    inputs = [q, k0, v0, *[x for kv in diag for x in kv]]
    w = torch.randn(b, h, t, d, device=dev) * real

    def run(fn):
        out = fn(*inputs[:3], [(inputs[3 + 2 * j], inputs[4 + 2 * j]) for j in range(3)])
        grads = torch.autograd.grad((out.double() * w).sum(), inputs)
        return out.double() * real, [g.double() for g in grads]

    ranges = sample_ranges(seg, b, t)
    new = run(lambda a, b_, c, dg: chain_attention(a, b_, c, dg, ranges, None, buckets=True))
    old = run(lambda a, b_, c, dg: chain_attention(a, b_, c, dg, ranges, None, buckets=True, sentinel=True))
    exact = run(lambda a, b_, c, dg: dense_chain_reference(a.double(), b_.double(), c.double(),
                                                           [(x.double(), y.double()) for x, y in dg], seg))
    for n, o, e in zip([new[0], *new[1]], [old[0], *old[1]], [exact[0], *exact[1]]):
        err, ref = (n - e).abs(), (o - e).abs()
        assert float(err.max()) <= 2 * float(ref.max()) + 1e-2 * float(e.abs().max()), (float(err.max()), float(ref.max()))
