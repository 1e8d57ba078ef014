"""Mixed precision by policy: EAGLE-3's teacher labels once per micro-batch (golden against the per-step labels they
replace), bf16 head GEMMs within tolerance of fp32, norms that keep their input's dtype, the frozen target in the
training dtype, TF32 only on CUDA, and FSDP2 in bf16 with 2 gloo workers (units, one gather per step)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.nn.functional as F

from deepspec.config.model import ModelConfig
from deepspec.drafts import DraftBatch, get_algorithm
from deepspec.drafts.layers import RMSNorm, softcap
from deepspec.targets.tiny import tiny_config

VOCAB, HIDDEN = 96, 32


def _draft(algorithm: str = "eagle3", seed: int = 0, **kw):
    cfg = tiny_config("llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_hidden_layers=4, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    mc = ModelConfig(algorithm=algorithm, target_layer_ids=[0, 1, 2], **kw)
    torch.manual_seed(seed)
    draft = get_algorithm(algorithm).from_target_config(cfg, mc)
    draft.load_target_weights(torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN) * 0.3)
    if "d2t" in draft._buffers:
        draft.set_token_frequencies(torch.rand(VOCAB))
    for p in draft.parameters():
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    draft.train()
    return draft


def _batch(b: int, t: int, seed: int = 1) -> DraftBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    lm = torch.ones(b, t, dtype=torch.bool)
    lm[:, :5] = False
    if b > 1:
        lm[1, t - 40 :] = False
    return DraftBatch(ids, lm, torch.ones_like(lm), torch.randn(b, t, 3, HIDDEN, generator=g), torch.randn(b, t, HIDDEN, generator=g))


def _per_step_reference(draft, batch: DraftBatch) -> torch.Tensor:
    """EAGLE-3's loss with the target's labels recomputed in fp32 at every TTT step, what long samples ran before
    (autocast off, [rows, Dv] fp32 per step); the draft's own states come from the same ttt_steps."""
    ids, lm, am, fh = batch.input_ids, batch.loss_mask, batch.attention_mask, batch.final_hidden
    b, t = ids.shape
    cfg, cap = draft.model_cfg, draft.arch.logit_softcap
    rows = draft.target_lm_head[draft.draft_target_ids()].float()
    total = torch.zeros(())
    for k, _, normed in draft.ttt_steps(ids, batch.taps, with_normed=True, heads=False):
        m = t - 2 - k
        with torch.autocast("cpu", enabled=False):
            p_t = torch.softmax(softcap(fh[:, 1 + k : 1 + k + m].float() @ rows.T, cap) / cfg.label_temperature, -1)
        logp = torch.log_softmax(softcap(F.linear(normed[:, :m], draft.lm_head.weight).float(), cap), -1)
        v = (lm[:, 2 + k :] & am[:, 2 + k :]).float()
        ce = -(p_t * logp).sum(-1)
        total = total + cfg.step_loss_decay**k * (ce * v).sum() / v.sum().clamp(min=1)
    return total


@pytest.mark.slow
@pytest.mark.parametrize("logged", [False, True])
def test_teacher_once_per_micro_batch_equals_the_per_step_labels_above_the_old_cache_limit(logged, monkeypatch):
    """T = 2,200 > 2,097 (where the [B, T, Dv] label table stopped being cached): the labels are built once for all
    TTT steps, and loss and gradients equal the per-step fp32 computation."""
    import deepspec.drafts.eagle3 as eagle3

    calls = []
    real = eagle3.teacher_logits
    monkeypatch.setattr(eagle3, "teacher_logits", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    draft = _draft(draft_vocab_size=40, ttt_length=3, label_temperature=0.7, logit_softcap=15.0, vocab_chunk_rows=512)
    draft.train_metrics = logged
    batch = _batch(2, 2200)
    loss, metrics = draft.loss(batch)
    loss.backward()
    assert calls == [torch.Size([2 * 2200, HIDDEN])]  # one teacher pass over every row, not one per step
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    ref = _per_step_reference(draft, batch)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert grads
    for n, p in draft.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    assert ("expected_tau" in metrics) == logged


def _loss_and_grads(draft, batch, bf16: bool):
    draft.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss, metrics = draft.loss(batch)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in draft.parameters() if p.grad is not None])
    return float(loss.detach()), grads, metrics


@pytest.mark.parametrize("algorithm, kw", [("eagle3", {"draft_vocab_size": 40, "ttt_length": 3}),
                                           ("dflash", {"num_anchors": 8, "block_size": 4}),
                                           ("dspark", {"num_anchors": 8, "block_size": 4, "markov_rank": 8})])
def test_bf16_losses_are_within_tolerance_of_fp32(algorithm, kw):
    """bf16 head GEMMs with fp32 softmax / log-normalisers: the loss within 2% of fp32, the gradient pointing the same
    way (cosine > 0.99). The frozen target is held in bf16 as training in bf16 does."""
    draft = _draft(algorithm, **kw)
    batch = _batch(2, 96)
    torch.manual_seed(3)
    l32, g32, _ = _loss_and_grads(draft, batch, bf16=False)
    draft.hold_target_in(torch.bfloat16)
    torch.manual_seed(3)  # the same anchors
    l16, g16, m16 = _loss_and_grads(draft, batch, bf16=True)
    assert draft.target_lm_head.dtype == torch.bfloat16
    assert abs(l16 - l32) <= 0.02 * abs(l32), (l16, l32)
    assert float(F.cosine_similarity(g16, g32, dim=0)) > 0.99
    assert all(torch.isfinite(v[0]).all() for v in m16.values())


def test_teacher_labels_are_bf16_under_autocast_and_fp32_without():
    from deepspec.drafts.losses import teacher_logits

    fh, head = torch.randn(10, HIDDEN), torch.randn(VOCAB, HIDDEN)
    ids = torch.arange(0, VOCAB, 3)
    full = teacher_logits(fh, head, chunk=4, draft_ids=ids, full_stats=True)
    rows = teacher_logits(fh, head, chunk=3, draft_ids=ids)
    assert full.logits.dtype == rows.logits.dtype == torch.float32
    torch.testing.assert_close(full.logits, fh @ head[ids].T)
    torch.testing.assert_close(rows.logits, fh @ head[ids].T)
    torch.testing.assert_close(full.lse_full, torch.logsumexp(fh @ head.T, -1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = teacher_logits(fh, head, chunk=4, draft_ids=ids, full_stats=True)
    assert low.logits.dtype == torch.bfloat16 and low.lse_full.dtype == torch.float32
    torch.testing.assert_close(low.logits.float(), full.logits, rtol=0.05, atol=0.1)


def test_rmsnorm_returns_its_inputs_dtype():
    x = torch.randn(3, 16)
    for offset in (0.0, 1.0):
        norm = RMSNorm(16, offset=offset)
        norm.weight.data.uniform_(-0.5, 1.5)
        assert norm(x).dtype == torch.float32
        out = norm(x.bfloat16())
        assert out.dtype == torch.bfloat16  # an fp32 weight used to promote it to fp32
        torch.testing.assert_close(out.float(), norm(x), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_backward_equals_autograd_on_the_eager_formula(dtype, offset, monkeypatch):
    """The norm keeps only its input and the inverse RMS for backward: values and gradients equal autograd through
    the eager formula (fp32: to rounding; bf16: within one bf16 rounding of the input gradient, since the eager
    formula rounds its gradient at the normalised tensor to bf16 and this one does not), and it keeps fewer bytes."""
    from deepspec.drafts import layers

    monkeypatch.setattr(layers, "_NORM_CHUNK", 64 * 3 * 2)  # slices of 2 tokens: the sliced arithmetic is exercised
    torch.manual_seed(0)
    norm = RMSNorm(64, offset=offset)
    norm.weight.data.uniform_(-0.5, 1.5)
    x = (torch.randn(3, 64, 5) * 3).to(dtype).transpose(1, 2).requires_grad_()  # a strided view, as q / k arrive
    gy = torch.randn(3, 5, 64).to(dtype)
    out, ref = norm(x), norm.reference(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref)  # the same forward arithmetic (sliced: fp32 sums may differ in the last bit)
    got = torch.autograd.grad(out, [x, norm.weight], gy)
    want = torch.autograd.grad(ref, [x, norm.weight], gy)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)
    # fewer saved bytes: the eager formula keeps an fp32 copy of x and the normalised x besides
    def saved(fn):
        nbytes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: nbytes.append(t.numel() * t.element_size()) or t, lambda t: t):
            fn(x)
        return sum(nbytes)
    assert saved(norm) < saved(norm.reference)


def test_setup_precision_holds_the_frozen_target_in_the_training_dtype(monkeypatch):
    from deepspec.train import precision

    draft = _draft(draft_vocab_size=40, ttt_length=2)
    assert precision.setup_precision(draft, "auto", torch.device("cpu")) == torch.float32
    assert draft.target_embed.dtype == draft.target_lm_head.dtype == torch.float32
    monkeypatch.setattr("deepspec.cpus.cpu_has_native_bf16", lambda *a: False)
    assert precision.resolve_precision("bf16_if_native", torch.device("cpu")) == "fp32"
    assert precision.resolve_precision("bf16_if_native", torch.device("cuda")) == "bf16"
    assert precision.setup_precision(draft, "bf16", torch.device("cpu")) == torch.bfloat16
    assert draft.target_embed.dtype == draft.target_lm_head.dtype == torch.bfloat16
    assert "target_lm_head" in dict(draft.named_buffers())  # still a buffer (checkpoints skip it, devices move it)
    assert torch.get_float32_matmul_precision() == "highest"  # CPU: exact fp32 matmuls stay
    before = torch.get_float32_matmul_precision()
    try:
        precision.enable_tf32(torch.device("cuda"))
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_fsdp_units_cover_every_decoder_layer_including_eagle3_midlayer():
    from deepspec.train.parallel import fsdp_units

    one = _draft(draft_vocab_size=40, ttt_length=2)
    assert one.midlayer.mlp in fsdp_units(one)
    two = _draft(draft_vocab_size=40, ttt_length=2, num_draft_layers=2)
    units = fsdp_units(two)
    assert two.midlayer.mlp in units and two.layers[0].mlp in units
    block = _draft("dflash", num_anchors=8, block_size=4)
    assert all(layer.mlp in fsdp_units(block) for layer in block.layers)


# ----------------------------------------------------------------------------- FSDP2, 2 gloo workers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_worker(rank: int, port: int, out: str) -> None:
    """Our FSDP2 policy, then FSDP2's defaults, on the same seeds, in one process group (2 interpreters fewer)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for plain in (False, True):
            torch.save(_fsdp_run(rank, plain), os.path.join(out, f"rank{rank}.{'plain' if plain else 'ours'}.pt"))
    finally:
        dist.destroy_process_group()


def _fsdp_run(rank: int, plain: bool) -> dict:
    """2 steps x 2 micro-batches of a fresh draft (seeded) under our policy or FSDP2's defaults (`plain`)."""
    import torch.distributed as dist

    from deepspec.train.parallel import accumulating, fsdp_units, release_gathered, wrap

    draft = _draft(draft_vocab_size=40, ttt_length=3, num_draft_layers=2)
    draft.hold_target_in(torch.bfloat16)
    wrapped = wrap(draft, "fsdp", 2, torch.device("cpu"), torch.bfloat16)
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    gathers = []
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"  # FSDP2's collective
    real = getattr(dist, name)
    setattr(dist, name, lambda *a, **kw: gathers.append(a[0].dtype) or real(*a, **kw))
    seen = {}
    draft.midlayer.mlp.register_forward_hook(lambda m, i, o: seen.update(mlp_weight=m.up_proj.weight.dtype))
    before = {n: p.detach().full_tensor().clone() for n, p in wrapped.named_parameters()}
    losses = []
    for step in range(2):
        for m in range(2):  # two micro-batches per step
            if plain:  # FSDP2's defaults: reshard after every backward
                wrapped.set_requires_gradient_sync(m == 1)
            else:
                accumulating(wrapped, last=m == 1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = wrapped(_batch(1, 40, seed=10 + 4 * step + 2 * m + rank))
            loss.backward()
            losses.append(float(loss.detach()))
        if not plain:
            release_gathered(wrapped)
        grad_dtypes = sorted({str(p.grad.dtype) for p in wrapped.parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    setattr(dist, name, real)
    after = {n: p.detach().full_tensor() for n, p in wrapped.named_parameters()}
    return {"losses": losses, "gathers": len(gathers), "gather_dtypes": sorted({str(d) for d in gathers}),
            "units": len(fsdp_units(draft)), "moved": sum(int(not torch.equal(before[n], after[n])) for n in before),
            "params": len(before), "master": sorted({str(p.dtype) for p in wrapped.parameters()}),
            "seen": {k: str(v) for k, v in seen.items()}, "grad_dtypes": grad_dtypes}


def _run_fsdp(out) -> tuple[list[dict], list[dict]]:
    """(ours, plain): each rank's figures under our policy and under FSDP2's defaults."""
    import torch.multiprocessing as mp

    out.mkdir()
    mp.spawn(_fsdp_worker, args=(_free_port(), str(out)), nprocs=2, join=True)
    return tuple([torch.load(out / f"rank{r}.{mode}.pt") for r in range(2)] for mode in ("ours", "plain"))


@pytest.mark.slow
def test_fsdp2_bf16_policy_trains_with_one_gather_per_unit_and_step(tmp_path):
    """2 gloo workers x 2 steps x 2 micro-batches: bf16 parameters gathered, fp32 master weights and gradients, midlayer's
    MLP a unit of its own. `accumulating` + `release_gathered` gather every unit once per step (the units serve 3 TTT
    steps x 2 micro-batches and their backwards) and train exactly as FSDP2's defaults, which gather the
    multi-use EAGLE-3 blocks again in the backward."""
    rows, plain = _run_fsdp(tmp_path / "fsdp")
    for r in rows:
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        assert r["moved"] == r["params"]  # every trainable tensor took the steps
        assert r["master"] == ["torch.float32"] and r["grad_dtypes"] == ["torch.float32"]
        assert r["seen"]["mlp_weight"] == "torch.bfloat16"  # gathered in bf16 for the forward
        assert r["gather_dtypes"] == ["torch.bfloat16"]  # gloo gathers bf16; gradients reduce in fp32
    units = rows[0]["units"] + 1  # + the root unit
    assert rows[0]["gathers"] == 2 * units, rows[0]
    assert plain[0]["gathers"] > 2 * units, plain[0]
    for r, p in zip(rows, plain):  # the same training: no stale gathered weights after an optimizer step
        assert r["losses"] == pytest.approx(p["losses"], abs=1e-4)


# ----------------------------------------------------------------------------- Liger's fused linear KL behind soft_ce


def _eager_kl(h, head, target):
    """The contract deepspec/drafts/liger.py relies on, written eagerly: sum_r sum_v q (log q - log softmax(h head^T))."""
    logp = torch.log_softmax((h @ head.T).float(), -1)
    q = target.float()
    return (torch.xlogy(q, q) - q * logp).sum()


def _eager_contract(h, head, target, shift_labels, reduction, ignore_index, has_label, temperature, eps, accum_dtype):
    """Liger's `fused_linear_kl_div_forward` as deepspec/drafts/liger.py calls it, eagerly: (loss, dL/dh, dL/dhead)."""
    assert (shift_labels, reduction, has_label, temperature, accum_dtype) == (None, "sum", False, 1.0, torch.float32)
    with torch.enable_grad():
        hh, ww = h.detach().requires_grad_(), head.detach().requires_grad_()
        loss = _eager_kl(hh, ww, target)
        gh, gw = torch.autograd.grad(loss, (hh, ww))
    return loss.detach(), gh.to(h.dtype), gw.to(head.dtype)


def test_liger_function_scales_its_gradients_on_the_device(monkeypatch):
    """deepspec's autograd Function around Liger's fused forward: the gradients it computed in the forward, times
    whatever scales the loss on the way back (EAGLE-3's step decay), equal autograd's through the eager contract; and
    its backward reads nothing on the host - run on the meta device, where any such read raises (Liger's own backward
    asks `grad_output != 1` as a Python bool: two host syncs per call on the GPU)."""
    from deepspec.drafts import liger

    monkeypatch.setattr(liger, "_contract_forward", _eager_contract)
    g = torch.Generator().manual_seed(1)
    h0, head0, q = torch.randn(9, 8, generator=g), torch.randn(12, 8, generator=g), torch.rand(9, 12, generator=g)
    grads = []
    for kl in (_eager_kl, liger.FusedLinearKL.apply):
        h, head = h0.clone().requires_grad_(), head0.clone().requires_grad_()
        (kl(h, head, q) * 0.8 + 1.5).backward()
        grads.append((h.grad, head.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    h = torch.empty(9, 8, device="meta", requires_grad=True)
    head = torch.empty(12, 8, device="meta", requires_grad=True)
    (liger.FusedLinearKL.apply(h, head, torch.empty(9, 12, device="meta")) * 0.8).backward()
    assert h.grad.shape == (9, 8) and head.grad.shape == (12, 8)


@pytest.mark.parametrize("stand_in", ["function", "forward"])
def test_liger_wrapper_reproduces_the_eager_soft_ce_value_and_gradients(monkeypatch, stand_in):
    """Per-row weights folded into the target rows (zero rows = ignored) and the entropy term added back: the fused path
    returns the eager loss value and gradients. Stands in for the CUDA kernel on CPU: the whole fused function, or
    only Liger's forward under deepspec's autograd Function."""
    from deepspec.drafts import liger
    from deepspec.drafts.losses import soft_ce

    fused_kl = _eager_kl
    if stand_in == "forward":
        monkeypatch.setattr(liger, "_contract_forward", _eager_contract)
        fused_kl = liger.FusedLinearKL.apply

    g = torch.Generator().manual_seed(0)
    h0, head0 = torch.randn(37, 16, generator=g), torch.randn(24, 16, generator=g)
    teacher, rows = torch.randn(50, 24, generator=g) * 2, torch.randint(0, 50, (37,), generator=g)
    weights = torch.rand(37, generator=g) * (torch.rand(37, generator=g) > 0.3)
    out = {}
    for fused in (False, True):
        if fused:
            monkeypatch.setattr(liger, "fused_linear_kl", fused_kl)
            monkeypatch.setattr(liger, "available", lambda x: True)
        h, head = h0.clone().requires_grad_(), head0.clone().requires_grad_()
        total, ce, *_ = soft_ce(h, head, weights, teacher, rows, chunk=8, label_temperature=0.7, loss_only=True)
        total.backward()
        out[fused] = (total.detach(), h.grad, head.grad, ce)
    torch.testing.assert_close(out[True][0], out[False][0])
    torch.testing.assert_close(out[True][1], out[False][1])
    torch.testing.assert_close(out[True][2], out[False][2])
    assert out[True][3] is None and out[False][3] is not None  # per-row outputs only from the eager path


@pytest.mark.parametrize("rows", [1, 2], ids=["one-row", "two-rows"])
def test_eagle3_unlogged_steps_through_the_fused_kernel_train_as_the_eager_path(monkeypatch, rows):
    """Unlogged EAGLE-3 steps through the fused path train as the eager one; the label distribution the fused path
    reads is made once per micro-batch (`teacher_dist`), not once per TTT step (one row: its steps read slices of
    the table; two rows: gathered rows)."""
    from deepspec.drafts import liger, losses

    draft = _draft(draft_vocab_size=40, ttt_length=3)
    draft.train_metrics = False
    batch = _batch(rows, 64)
    res = {}
    per_step = []  # the per-step fallback inside the fused path: never taken when EAGLE-3 passes its table
    made = losses.teacher_dist
    monkeypatch.setattr(losses, "teacher_dist", lambda *a, **k: per_step.append(1) or made(*a, **k))
    for fused in (False, True):
        if fused:
            monkeypatch.setattr(liger, "fused_linear_kl", _eager_kl)
            monkeypatch.setattr(liger, "available", lambda x: True)
        draft.zero_grad()
        loss, metrics = draft.loss(batch)
        loss.backward()
        res[fused] = (loss.detach(), torch.cat([p.grad.flatten() for p in draft.parameters() if p.grad is not None]), metrics)
    torch.testing.assert_close(res[True][0], res[False][0])
    torch.testing.assert_close(res[True][1], res[False][1])
    assert "step_loss@1" in res[False][2] and "step_loss@1" not in res[True][2]
    assert per_step == []


def test_the_once_per_micro_batch_label_table_is_what_each_step_computed(monkeypatch):
    """The fused path fed the micro-batch's TeacherDist (read at shifted rows, or a slice) gives bit for bit the loss
    and gradients it gave computing the distribution from the teacher's logits at every call."""
    from deepspec.drafts import liger
    from deepspec.drafts.losses import soft_ce, teacher_dist

    monkeypatch.setattr(liger, "fused_linear_kl", _eager_kl)
    monkeypatch.setattr(liger, "available", lambda x: True)
    g = torch.Generator().manual_seed(2)
    h0, head0 = torch.randn(37, 16, generator=g), torch.randn(24, 16, generator=g)
    teacher = (torch.randn(50, 24, generator=g) * 3).bfloat16()
    weights = torch.rand(37, generator=g) * (torch.rand(37, generator=g) > 0.3)
    table = teacher_dist(teacher, 12.0, 0.7, chunk=7)
    for rows, dist in ((torch.arange(37) + 5, table), (None, table[5:42])):
        out = []
        for d in (None, dist):
            h, head = h0.clone().requires_grad_(), head0.clone().requires_grad_()
            sub = teacher if rows is not None else teacher[5:42]
            total, *_ = soft_ce(h, head, weights, sub, rows, chunk=8, label_temperature=0.7, target_softcap=12.0,
                                loss_only=True, dist=d)
            total.backward()
            out.append((total.detach(), h.grad, head.grad))
        for a, b in zip(*out):
            assert torch.equal(a, b)


def test_liger_is_optional_and_off_the_cpu():
    from deepspec.drafts import liger

    assert not liger.available(torch.zeros(1))  # CPU tensors never take the kernel, installed or not


@pytest.mark.cuda(reason="Liger's Triton kernels")
def test_liger_kernel_on_cuda_matches_the_eager_soft_ce_in_bf16():
    from deepspec.drafts import liger
    from deepspec.drafts.losses import soft_ce

    if liger.fused_linear_kl is None:
        pytest.skip("liger-kernel is not installed (requirements-gpu.txt)")
    g = torch.Generator(device="cuda").manual_seed(0)
    h0 = torch.randn(1024, 256, device="cuda", generator=g)
    head0 = torch.randn(4096, 256, device="cuda", generator=g) * 0.05
    teacher = (torch.randn(1100, 4096, device="cuda", generator=g) * 3).bfloat16()
    rows, weights = torch.arange(1024, device="cuda") + 50, torch.rand(1024, device="cuda", generator=g)
    out = []
    for use in ("0", "1"):
        os.environ["DEEPSPEC_LIGER"] = use
        h, head = h0.clone().requires_grad_(), head0.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            total, *_ = soft_ce(h, head, weights, teacher, rows, chunk=256, loss_only=True)
        total.backward()
        out.append((total.detach(), h.grad, head.grad))
    os.environ.pop("DEEPSPEC_LIGER")
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-2, atol=1e-2)
    for a, b in zip(out[1][1:], out[0][1:]):
        assert float(F.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0)) > 0.999
