"""The step plan (deepspec/drafts/plan.py): a training step reads no device value back when the loader planned its
batch, bucketed attention shapes are few and give the exact results, and the loader's plan is the draft's own."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from deepspec.config.model import ModelConfig
from deepspec.drafts import DraftBatch, get_algorithm
from deepspec.drafts import attention
from deepspec.drafts.attention import BlockBounds, block_attention, chain_attention, dense_block_reference, dense_chain_reference
from deepspec.drafts.checkpoint import target_weights
from deepspec.drafts.plan import bucket, sample_ranges
from deepspec.targets import capture, tiny_target
from deepspec.data.batches import pack_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = dict(rtol=1e-5, atol=1e-5)
ALGORITHMS = ["eagle3", "dflash", "dspark", "dflash2"]


def _draft(algorithm: str, window: int | None = None, num_anchors: int = 4):
    torch.manual_seed(0)
    model, _ = tiny_target("qwen3")
    types = None if window is None else ["sliding_attention", "full_attention"]
    cfg = ModelConfig(algorithm=algorithm, target_layer_ids=[0, 2, 4], num_draft_layers=2, ttt_length=3, block_size=4,
                      num_anchors=num_anchors, markov_rank=8, layer_types=types, sliding_window=window)
    draft = get_algorithm(algorithm).from_target_config(model.config, cfg)
    draft.load_target_weights(*target_weights(model))
    if algorithm == "eagle3":
        draft.set_token_frequencies(torch.arange(320).float())
    draft.train()
    return model, draft


def _batch(model, draft, lengths: list[int], seed: int = 1) -> DraftBatch:
    """A right-padded batch of samples of `lengths` (answers = their second half)."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(0, 250, (len(lengths), t), generator=g)
    am = torch.zeros(len(lengths), t, dtype=torch.bool)
    lm = torch.zeros_like(am)
    for r, n in enumerate(lengths):
        am[r, :n] = True
        lm[r, n // 2 : n] = True
    taps, final = capture(model, ids, draft.taps)
    return DraftBatch(ids, lm, am, taps, final)


def _on_meta(draft, batch):
    """Loss + backward with the draft and the batch on the meta device, where reading any value raises."""
    d = copy.deepcopy(draft).to("meta")
    loss, metrics = d.loss(batch.to("meta"))
    loss.backward()
    return loss, metrics


@pytest.mark.parametrize("layout", ["padded", "packed", "windowed"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_step_reads_no_device_value_when_the_loader_planned_it(algorithm, layout):
    """Forward + backward on the meta device: a `.tolist()`, `.item()` or `int(t)` anywhere in the step raises there.
    With the loader's plan nothing does; without one, the block drafts (anchors) and packed EAGLE-3 (sample bounds)
    must read the batch — which shows the probe catches a read."""
    model, draft = _draft(algorithm, window=5 if layout == "windowed" else None)
    batch = _batch(model, draft, [14, 9, 11])
    if layout == "packed":
        batch = pack_batch(batch, 24)
        assert batch.segment_ids is not None and batch.input_ids.shape[0] < 3
    for buckets in (False, True):
        batch.plan = draft.plan_batch(batch, key=7, buckets=buckets)  # what the loader does, on the CPU batch
        loss, _ = _on_meta(draft, batch)
        assert loss.device.type == "meta"
    batch.plan = None
    if algorithm != "eagle3" or layout == "packed":
        with pytest.raises((RuntimeError, NotImplementedError)):
            _on_meta(draft, batch)


@pytest.mark.parametrize("sentinel", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("step", [0, 2])
def test_bucketed_chain_attention_equals_the_dense_reference(packed, step, sentinel):
    """Causal calls padded to a ladder length (and, merged through the flash kernel's lse, its backward handed the
    padded rows): the dense reference's values and gradients on the real rows."""
    torch.manual_seed(0)
    b, h, hk, t, d = 2, 4, 2, 37, 16  # 37 rows: padded to 64, the ladder's first length
    q = torch.randn(b, h, t, d, requires_grad=True)
    k0, v0 = torch.randn(b, hk, t, d, requires_grad=True), torch.randn(b, hk, t, d, requires_grad=True)
    diag = [(torch.randn(b, hk, t, d, requires_grad=True), torch.randn(b, hk, t, d, requires_grad=True)) for _ in range(step)]
    seg = None
    if packed:
        seg = torch.zeros(b, t, dtype=torch.long)
        seg[0, 20:] = 1
        seg[1, 30:] = -1
    out = chain_attention(q, k0, v0, diag, sample_ranges(seg, b, t), None, buckets=True, sentinel=sentinel)
    ref = dense_chain_reference(q, k0, v0, diag, seg)
    rows = torch.ones(b, t, dtype=torch.bool) if seg is None else seg >= 0
    torch.testing.assert_close(out[rows.unsqueeze(1).expand(-1, h, -1)], ref[rows.unsqueeze(1).expand(-1, h, -1)], **TOL)
    w = torch.randn(out.shape) * rows[:, None, :, None]
    inputs = [q, k0, v0, *[x for kv in diag for x in kv]]
    for a, r in zip(torch.autograd.grad((out * w).sum(), inputs), torch.autograd.grad((ref * w).sum(), inputs)):
        torch.testing.assert_close(a, r, **TOL)


@pytest.mark.parametrize("window", [None, 5])
def test_bucketed_block_attention_equals_the_dense_reference(window):
    """Bucketed chunks read more context keys than their blocks see (a ladder length, past the batch's rows): the masks
    hide them, values and gradients included."""
    torch.manual_seed(0)
    b, h, hk, t, k_n, a_n, d = 2, 4, 2, 37, 4, 6, 16
    anchors = torch.tensor([[0, 3, 9, 17, 25, 33], [2, 5, 8, 20, 31, 0]])
    start = torch.tensor([[0, 0, 0, 0, 21, 21], [0, 0, 0, 15, 15, 0]])  # packed: second samples start at 21 / 15
    keep = torch.tensor([[True] * 6, [True] * 5 + [False]])
    valid = torch.ones(b, t, dtype=torch.bool)
    q = torch.randn(b, h, a_n * k_n, d, requires_grad=True)
    kb, vb = (torch.randn(b, hk, a_n * k_n, d, requires_grad=True) for _ in range(2))
    kc, vc = (torch.randn(b, hk, t, d, requires_grad=True) for _ in range(2))
    bounds = BlockBounds.of(anchors, start, keep, t, buckets=True)
    assert bounds.key_rows == 64 and len({a1 - a0 for a0, a1, _, _ in bounds.chunks(window, k_n, b, h // hk)}) == 1
    out = block_attention(q, kb, vb, kc, vc, anchors, start, keep, valid, window, bounds)
    ref = dense_block_reference(q, kb, vb, kc, vc, anchors, start, keep, valid, window)
    torch.testing.assert_close(out, ref, **TOL)
    w = torch.randn_like(out)
    g1 = torch.autograd.grad((out * w).sum(), [q, kb, vb, kc, vc])
    g2 = torch.autograd.grad((ref * w).sum(), [q, kb, vb, kc, vc])
    for a, r in zip(g1, g2):
        torch.testing.assert_close(a, r, **TOL)


def _flex_case(device: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    b, h, hk, t, k_n, a_n, d = 2, 4, 2, 37, 4, 6, 16
    anchors = torch.tensor([[0, 3, 9, 17, 25, 33], [2, 5, 8, 20, 31, 0]], device=device)
    start = torch.tensor([[0, 0, 0, 0, 21, 21], [0, 0, 0, 15, 15, 0]], device=device)  # packed: second samples
    keep = torch.tensor([[True] * 6, [True] * 5 + [False]], device=device)
    valid = torch.ones(b, t, dtype=torch.bool, device=device)
    valid[1, 34:] = False  # padding rows of the second row
    q = torch.randn(b, h, a_n * k_n, d, device=device, dtype=dtype)
    kb, vb = (torch.randn(b, hk, a_n * k_n, d, device=device, dtype=dtype) for _ in range(2))
    kc, vc = (torch.randn(b, hk, t, d, device=device, dtype=dtype) for _ in range(2))
    return (q, kb, vb, kc, vc), (anchors, start, keep, valid), BlockBounds.of(anchors, start, keep, t, buckets=True)


@pytest.mark.parametrize("window", [None, 5])
def test_flex_block_attention_equals_the_dense_reference(window):
    """train.attention=flex: one FlexAttention call per layer with the step's block mask, bucketed context rows
    included, equals the dense reference (PyTorch's unfused reference on a CPU, which has no backward: gradients are
    compared by the CUDA test below)."""
    import warnings

    from deepspec.drafts.flex import flex_block_attention

    tensors, meta, bounds = _flex_case("cpu")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": the unfused reference is the point on a CPU
        out = flex_block_attention(*tensors, *meta, window, bounds)
        ref = dense_block_reference(*tensors, *meta, window)
    torch.testing.assert_close(out, ref, **TOL)
    with pytest.raises(Exception, match="CUDA"):
        flex_block_attention(*(x.requires_grad_() for x in tensors), *meta, window, bounds)


def test_flex_on_cuda_compiles_every_bucket_a_run_can_meet():
    """Each context bucket (x windowed layers x validation's no-grad) is its own compiled FlexAttention kernel; past
    Dynamo's recompile limit a new one would silently run the unfused reference (every score materialised). Setting
    the CUDA kernels up raises the limit above every shape samples of up to 32,768 tokens can need."""
    from deepspec.drafts import flex
    from deepspec.drafts.plan import bucket

    config = torch._dynamo.config
    saved = config.recompile_limit, config.accumulated_recompile_limit
    flex._kernels.cache_clear()
    try:
        config.recompile_limit = 8
        flex._kernels("cuda")
        shapes = len({bucket(n) for n in range(1, 32_769)}) * 2 * 2  # buckets x (windowed or not) x (grad or not)
        assert shapes == 76 and config.recompile_limit >= shapes and config.accumulated_recompile_limit >= 2 * shapes
    finally:
        config.recompile_limit, config.accumulated_recompile_limit = saved
        flex._kernels.cache_clear()


def test_the_compiled_block_mask_equals_the_eager_one_and_compiles_once_for_every_step_of_a_shape(monkeypatch):
    """On CUDA the step's block mask comes from torch.compile(create_block_mask) (torch's replacement for its deprecated
    `_compile=True`). Each step builds a new mask_mod closure over new anchors; with the shapes unchanged it must reuse
    the compiled graph (a compile per step would cost seconds of host time) and give the eager builder's mask. Counted
    on a CPU with Dynamo's eager backend: the same capture and guards as on CUDA, without Inductor's code generation."""
    import warnings

    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.nn.attention.flex_attention import create_block_mask

    from deepspec.drafts import flex

    assert "_compile" not in inspect.getsource(flex._block_mask)  # the deprecated flag stays out
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(create_block_mask, backend=counter)
    b, a_n, k_n, t = 2, 8, 4, 64
    frames = []
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        anchors = torch.sort(torch.randint(1, t, (b, a_n), generator=g), dim=1).values
        start = torch.zeros(b, a_n, dtype=torch.long)
        start[1, a_n // 2 :] = anchors[1, a_n // 2 - 1]  # packed: the second row's later blocks start a new sample
        keep = torch.rand(b, a_n, generator=g) > 0.2
        valid = torch.ones(b, t, dtype=torch.bool)
        valid[1, t - 5 :] = False
        masks = []
        for build in (create_block_mask, compiled):
            monkeypatch.setattr(flex, "_kernels", lambda device_type, build=build: (None, build))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                masks.append(flex._block_mask(anchors, start, keep, valid, k_n, 5 if step % 2 else None, t, torch.device("cpu")))
        eager, built = masks
        assert torch.equal(eager.to_dense(), built.to_dense()), step
        assert torch.equal(eager.kv_num_blocks, built.kv_num_blocks) and torch.equal(eager.kv_indices, built.kv_indices)
        frames.append(counter.frame_count)
    # one graph without a window, one with: steps 2 and 3 (new anchors, same shapes) compile nothing new
    assert frames[1] == frames[3] == frames[0] + frames[0] and frames[2] == frames[1], frames
    torch._dynamo.reset()


@pytest.mark.cuda(reason="FlexAttention's compiled kernel and its backward")
@pytest.mark.parametrize("window", [None, 5])
def test_flex_block_attention_on_cuda_equals_the_dense_reference_with_gradients(window):
    from deepspec.drafts.flex import flex_block_attention

    tensors, meta, bounds = _flex_case("cuda")
    tensors = [x.requires_grad_() for x in tensors]
    out = flex_block_attention(*tensors, *meta, window, bounds)
    ref = dense_block_reference(*tensors, *meta, window)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)  # TF32-free fp32 on both, another summation order
    w = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad((out * w).sum(), tensors), torch.autograd.grad((ref * w).sum(), tensors)):
        torch.testing.assert_close(a, r, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("algorithm", ["dflash", "dspark", "dflash2"])
def test_flex_and_sdpa_plans_train_alike(algorithm):
    """The same packed batch and anchors through train.attention=flex and the chunked SDPA calls: the same loss (forward
    only on a CPU)."""
    import warnings

    model, draft = _draft(algorithm)
    batch = pack_batch(_batch(model, draft, [14, 9, 11, 6]), 26)
    losses = []
    for kernel in ("sdpa", "flex"):
        batch.plan = draft.plan_batch(batch, key=3, buckets=True)
        batch.plan.kernel = kernel
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            losses.append(draft.loss(batch)[0])
    torch.testing.assert_close(losses[1], losses[0], **TOL)


def test_auto_attention_is_flex_only_for_packed_rows_on_cuda():
    """train.attention=auto (the default): FlexAttention where it was measured faster (CUDA, packed rows of one
    length), the chunked SDPA calls elsewhere; an explicit choice is kept; the loader's planner takes only a resolved
    kernel, so a run that forgot to resolve `auto` fails instead of training on a kernel nobody chose."""
    from deepspec.config.train import TrainConfig
    from deepspec.drafts.plan import resolve_kernel
    from deepspec.errors import ConfigError
    from deepspec.train.loader import step_planner

    assert TrainConfig().attention == "auto"
    assert resolve_kernel("auto", "cuda", packed=True) == "flex"
    assert resolve_kernel("auto", torch.device("cuda", 0), packed=True) == "flex"
    assert resolve_kernel("auto", "cuda", packed=False) == "sdpa"
    assert resolve_kernel("auto", "cpu", packed=True) == "sdpa"
    assert resolve_kernel("flex", "cpu", packed=False) == "flex" and resolve_kernel("sdpa", "cuda", packed=True) == "sdpa"
    with pytest.raises(ValueError, match="resolved kernel"):
        step_planner(object(), lambda s, m: 0, False, "auto")
    with pytest.raises(ConfigError, match="auto, sdpa or flex"):
        TrainConfig(attention="fast").validate()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_bucketed_and_exact_plans_train_alike(algorithm):
    """The same anchors through bucketed and exact attention calls: the same loss, metrics and gradients (fp32)."""
    model, draft = _draft(algorithm)
    batch = pack_batch(_batch(model, draft, [14, 9, 11, 6]), 26)
    results = []
    for buckets in (False, True):
        batch.plan = draft.plan_batch(batch, key=3, buckets=buckets)
        draft.zero_grad()
        loss, metrics = draft.loss(batch)
        loss.backward()
        results.append((loss.detach(), {k: float(v[0]) for k, v in metrics.items()},
                        {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    (l0, m0, g0), (l1, m1, g1) = results
    torch.testing.assert_close(l1, l0, **TOL)
    assert m1.keys() == m0.keys() and all(m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6) for k in m0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], **TOL)


def _shapes_over_batches(algorithm: str, buckets: bool, packed: bool, n_batches: int = 50) -> set:
    """The distinct (query, key) shapes of every attention call over `n_batches` micro-batches of 2 samples of 40-300
    tokens, padded or packed (prefixes of one captured pair of 300-token rows: a causal target's taps of a prefix are
    the prefix of its taps)."""
    model, draft = _draft(algorithm, num_anchors=16)
    draft.train_metrics = False  # metrics of unlogged steps: the attention calls are the same
    full = _batch(model, draft, [300, 300], seed=9)
    seen: set = set()
    real = attention._sdpa

    def spy(q, k, v, scale, mask=None, is_causal=False):
        seen.add((tuple(q.shape), tuple(k.shape)))
        return real(q, k, v, scale, mask, is_causal)

    real_lse = attention._causal_lse

    def spy_lse(q, k, v, scale, forward, buckets):  # EAGLE-3's later TTT steps: the causal part with its lse
        out = real_lse(q, k, v, scale, forward, buckets)
        seen.add((tuple(q.shape[:2]) + (q.shape[2] + out[3].shape[2],) + tuple(q.shape[3:]),
                  tuple(k.shape[:2]) + (k.shape[2] + out[3].shape[2],) + tuple(k.shape[3:])))
        return out

    g = torch.Generator().manual_seed(4)
    attention._sdpa = spy
    attention._causal_lse = spy_lse
    try:
        with torch.no_grad():
            for i in range(n_batches):
                lengths = torch.randint(40, 301, (2,), generator=g).tolist()
                t = max(lengths)
                am = torch.arange(t)[None] < torch.tensor(lengths)[:, None]
                lm = am & (torch.arange(t)[None] >= torch.tensor(lengths)[:, None] // 2)
                batch = DraftBatch(full.input_ids[:, :t], lm, am, full.taps[:, :t], full.final_hidden[:, :t])
                if packed:
                    batch = pack_batch(batch, 640)
                batch.plan = draft.plan_batch(batch, key=i, buckets=buckets)
                draft.loss(batch)
    finally:
        attention._sdpa = real
        attention._causal_lse = real_lse
    return seen


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_attention_shapes_come_from_a_few_buckets(algorithm, packed):
    """Over 50 micro-batches of varied lengths, bucketed attention calls take a handful of shapes; exact ones take a new
    shape for nearly every batch. Lengths 40-300 span six ladder lengths (64..384); EAGLE-3's calls take one shape
    per length (its later TTT steps merge through the flash kernel's log-sum-exp: the head dim and rows of step 0), the
    block drafts a chunk length and a key length."""
    bucketed = _shapes_over_batches(algorithm, True, packed)
    exact = _shapes_over_batches(algorithm, False, packed, n_batches=12)
    limit = LIMITS[algorithm, packed]
    assert len(bucketed) <= limit, sorted(bucketed)
    assert len(exact) > limit


LIMITS = {("eagle3", False): 6, ("eagle3", True): 6, ("dflash", False): 8, ("dflash", True): 8, ("dspark", False): 8, ("dspark", True): 8,
          ("dflash2", False): 8, ("dflash2", True): 8}


def test_a_ladder_length_sample_keeps_its_length_with_the_sentinel_row(monkeypatch):
    """Later TTT steps put a sentinel row in front of a sample: the sample's rows are bucketed, not the call's (a
    4,096-token sample padded to 6,144 would cost half its attention again)."""
    seen = []
    real = attention._sdpa
    monkeypatch.setattr(attention, "_sdpa", lambda q, *a, **k: seen.append(q.shape[2]) or real(q, *a, **k))
    q, k0, v0 = torch.randn(1, 4, 64, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    chain_attention(q, k0, v0, [(torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16))], sample_ranges(None, 1, 64), None, True,
                    sentinel=True)
    chain_attention(q[:, :, :50], k0[:, :, :50], v0[:, :, :50], [], sample_ranges(None, 1, 50), None, True)
    assert seen == [65, 64]


def test_the_ladder():
    assert [bucket(n) for n in (1, 64, 65, 96, 97, 128, 129, 200, 4096, 4097)] == [64, 64, 96, 96, 128, 128, 192, 256, 4096, 6144]
    for n in range(1, 5000, 7):
        assert n <= bucket(n) <= max(64, n * 3 // 2 + 1)


def test_the_loader_plans_each_batch_with_its_micro_batch_seed():
    """The loader's plan is the draft's own for that key: the same anchors, and a loss equal to planning in the step."""
    from deepspec.data.batches import Prefetcher
    from deepspec.train.loader import step_planner

    model, draft = _draft("dflash")
    batches = [_batch(model, draft, [14, 9], seed=s) for s in range(3)]
    planner = step_planner(draft, lambda s, m: 1000 * s + m, buckets=False)
    schedule = [(s, 0, [s]) for s in range(3)]
    loader = Prefetcher(batches, lambda items: DraftBatch(**{f: getattr(items[0], f) for f in ("input_ids", "loss_mask", "attention_mask", "taps", "final_hidden")}),
                        schedule, depth=2, plan=planner)
    try:
        got = list(loader)
    finally:
        loader.close()
    assert [(s, m) for s, m, _ in got] == [(0, 0), (1, 0), (2, 0)]
    for s, _, b in got:
        assert b.plan is not None
        want = draft.plan_batch(batches[s], key=1000 * s)
        assert torch.equal(b.plan.anchors, want.anchors) and torch.equal(b.plan.keep, want.keep)
        with torch.no_grad():
            planned = draft.loss(b)[0]
            b.plan = None
            torch.manual_seed(0)
            here = draft.loss(b, anchors=want.anchors, keep=want.keep)[0]
        torch.testing.assert_close(planned, here, rtol=0, atol=0)


def test_the_diagonal_turns_tf32_off_through_the_precision_api_training_sets():
    """Training sets float32 matmul precision 'high' (TF32 on CUDA); the TTT diagonal's scores need IEEE fp32. The switch
    must not touch the legacy allow_tf32 flag: after set_float32_matmul_precision, torch raises on the mix."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        with attention._ieee_fp32(_Dev("cuda")):  # the switch reads only the device (no CUDA needed to set the flag)
            assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert torch.get_float32_matmul_precision() == "high"  # raised here when the legacy flag was flipped
    finally:
        torch.set_float32_matmul_precision(old)


class _Dev:
    def __init__(self, kind: str):
        self.device = torch.device(kind)
