"""Regional torch.compile of the draft layers (deepspec/train/compile.py): compiled = eager on the CPU for every
algorithm, values and gradients; training steps give eager's losses; new sequence lengths reuse the compiled graphs;
the compiled norm rounds like the eager one and keeps only what the memory-lean eager norm keeps.

Tolerances: fp32, 1e-5 relative. Inductor's CPU kernels sum a row in another order than ATen (vectorised partial sums),
so a norm's mean square or a GEMM epilogue may differ by a few fp32 units in the last place (~1e-7 relative); through
two layers, the attention and the loss that stays within ~1e-6, and 1e-5 leaves room without hiding a real error (a
wrong RoPE, norm or projection moves the loss by >1e-3). The first compilation of the regions takes ~1 min on 2 busy
CPU cores (a few seconds once Inductor's on-disk cache has them); the tests share one process's compiled graphs.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from deepspec.config.model import ModelConfig
from deepspec.drafts import DraftBatch, get_algorithm
from deepspec.drafts.checkpoint import target_weights
from deepspec.drafts.layers import Attention, RMSNorm
from deepspec.errors import ConfigError
from deepspec.targets import capture, tiny_target
from deepspec.train.compile import compile_draft, compiled_regions, keeps_bf16_round_trips, resolve_compile, uncompile_draft

RTOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    yield


def _draft(algorithm: str, **fields):
    torch.manual_seed(0)
    model, _ = tiny_target("qwen3")
    fields.setdefault("target_layer_ids", [0, 2, 4])
    cfg = ModelConfig(algorithm=algorithm, block_size=4, num_anchors=3, markov_rank=8, ttt_length=3, num_draft_layers=2, **fields)
    draft = get_algorithm(algorithm).from_target_config(model.config, cfg)
    draft.load_target_weights(*target_weights(model))
    with torch.no_grad():  # norms away from 1 and a live Markov head, so every weight shapes the loss
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.02))
    return model, draft


def _batch(target, draft, t: int, seed: int) -> DraftBatch:
    """Two rows; the second one's last 3 tokens are padding, and the loss skips the prompt's first 4 tokens."""
    ids = torch.randint(0, 250, (2, t), generator=torch.Generator().manual_seed(seed))
    taps, final = capture(target, ids, draft.taps)
    am = torch.ones_like(ids, dtype=torch.bool)
    am[1, -3:] = False
    lm = am.clone()
    lm[:, :4] = False
    return DraftBatch(ids, lm, am, taps, final)


def _loss_and_grads(draft, batch: DraftBatch):
    draft.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # block drafts draw their anchors
    loss, _ = draft.loss(batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def _assert_close(eager, compiled):
    (le, ge), (lc, gc) = eager, compiled
    assert torch.isfinite(le) and float(le) > 0
    assert abs(float(lc) - float(le)) <= RTOL * abs(float(le)), (float(le), float(lc))
    assert ge.keys() == gc.keys() and len(ge) > 5
    for name, g in ge.items():
        scale = float(g.abs().max())
        assert scale > 0, f"{name} has no gradient: the test would not see a wrong region"
        assert float((gc[name] - g).abs().max()) <= RTOL * scale, name


def _compiles() -> int:
    return counters["frames"]["ok"]


@pytest.mark.parametrize(
    "algorithm, fields",
    [
        ("eagle3", {"activation_checkpointing": True}),  # the TTT chain, its layers recomputed in the backward
        ("dflash", {}),
        ("dspark", {"activation_checkpointing": True}),
        ("dflash2", {"conv_group_size": 16, "selector_rank": 8}),  # the block convolutions stay eager between regions
    ],
)
@pytest.mark.slow
def test_compiled_layers_equal_eager_and_reuse_their_graphs_across_lengths(algorithm, fields):
    """Loss and every gradient of the compiled draft equal eager's (fp32, 1e-5 relative); the attention stays eager
    (no graph break: it is never traced); after the first batch, batches of other lengths compile nothing new."""
    target, draft = _draft(algorithm, **fields)
    lengths = (18, 23, 29)
    batches = [_batch(target, draft, t, seed=t) for t in lengths]
    eager = [_loss_and_grads(draft, b) for b in batches]

    assert compile_draft(draft, True)
    regions = compiled_regions(draft)
    # per decoder layer: 2 norms, the MLP, project_q / project_kv / output; the q/k norms are traced inside project_*;
    # a block draft's loss terms per chunk of rows (its own override where it has one)
    block = algorithm != "eagle3"
    extra = {"_chunk_terms"} if block else {"diagonal", "diagonal_backward", "merge", "merge_lse"}  # the TTT chain's
    assert {r.name for r in regions} == {"forward", "project_q", "project_kv", "output"} | extra
    if block:
        (terms,) = [r for r in regions if r.name == "_chunk_terms"]
        assert terms.owner is draft and terms.fn is type(draft)._chunk_terms
    assert len(regions) >= 2 * 6
    qk_norms = [n for a in draft.modules() if isinstance(a, Attention) for n in (a.q_norm, a.k_norm)]
    assert all(isinstance(n, RMSNorm) for n in qk_norms) and not any(r.owner is n for r in regions for n in qk_norms)
    breaks = sum(counters["graph_break"].values())
    _assert_close(eager[0], _loss_and_grads(draft, batches[0]))
    after_first = _compiles()
    for b, e in zip(batches[1:], eager[1:]):
        _assert_close(e, _loss_and_grads(draft, b))
    assert _compiles() == after_first, "a new sequence length recompiled a region"
    assert sum(counters["graph_break"].values()) == breaks

    uncompile_draft(draft)
    assert not compiled_regions(draft)
    assert float(_loss_and_grads(draft, batches[0])[0]) == float(eager[0][0])


def test_training_steps_with_compiled_layers_give_eager_losses():
    """Three AdamW steps on batches of three lengths: the same losses and weights with and without compilation."""

    def train(compiled: bool):
        target, draft = _draft("dflash")
        if compiled:
            compile_draft(draft, True)
        opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-3)
        losses = []
        for step, t in enumerate((18, 23, 29)):
            loss, _ = _loss_and_grads(draft, _batch(target, draft, t, seed=100 + step))
            opt.step()
            losses.append(float(loss))
        return losses, {n: p.detach().clone() for n, p in draft.named_parameters()}

    (le, we), (lc, wc) = train(False), train(True)
    assert lc == pytest.approx(le, rel=RTOL)
    assert le[0] != le[-1]  # the steps trained
    # AdamW divides each gradient element by its own RMS, so an element whose gradient is near zero turns fp32 rounding
    # into a visible share of its step: bound the weights by 1% of the most the three steps can move an element
    for name, w in we.items():
        assert float((wc[name] - w).abs().max()) <= 0.01 * 3 * 1e-3, name


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_compiled_norm_rounds_like_eager_in_bf16_and_keeps_only_its_input(offset):
    """bf16 in, bf16 out, fp32 arithmetic: the compiled norm equals the eager formula element for element (Llama/Qwen3
    round the normalised value before the weight, Gemma's 1 + weight scales in fp32), gradients included, and saves
    for backward what the memory-lean eager norm saves: the bf16 input and an fp32 value per row (no fp32 copy)."""
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6, offset)
    with torch.no_grad():
        norm.weight.add_(torch.randn(64) * 0.3)
    x = torch.randn(2, 9, 64, dtype=torch.bfloat16, requires_grad=True)
    assert torch.equal(norm(x), norm.reference(x))  # the eager norm (_RMSNormFn)
    if keeps_bf16_round_trips() or offset:
        ref = norm.reference(x)
    else:  # torch < 2.13 drops the rounding to bf16 before the weight (deepspec/train/compile.py): that formula instead
        xf = x.float()
        ref = (norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps))).to(x.dtype)
        assert not torch.equal(ref, norm.reference(x))  # the deviation the warning names is real at this shape
    ref_grads = torch.autograd.grad(ref.float().pow(2).sum(), [x, norm.weight])

    compile_draft(norm, True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = norm(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
    grads = torch.autograd.grad(y.float().pow(2).sum(), [x, norm.weight])
    # the input's gradient is a bf16 rounding of an fp32 value whose row sum Inductor adds in another order: an
    # element may land one bf16 step (2^-8 relative) away, rarely
    torch.testing.assert_close(grads[0], ref_grads[0], rtol=2**-7, atol=0)
    assert (grads[0] != ref_grads[0]).float().mean() < 0.01
    assert torch.allclose(grads[1], ref_grads[1], rtol=1e-5, atol=0)  # a sum over 18 rows, in another order
    # the input (bf16), the weight, one fp32 inverse RMS per row, scalars; autograd on the formula adds two fp32 copies
    limit = x.numel() * 2 + norm.weight.numel() * 4 + 2 * 9 * 4 + 16
    assert sum(t.numel() * t.element_size() for t in saved) <= limit, [(t.dtype, tuple(t.shape)) for t in saved]
    uncompile_draft(norm)


def test_train_compile_setting():
    """true / false mean compiled / eager anywhere; auto compiles on CUDA only; anything else is a config error."""
    from deepspec.config import load_config
    from deepspec.config.train import TrainConfig

    assert load_config(None, ["train.compile=auto"]).train.compile == "auto"
    assert resolve_compile(True, "cpu") and not resolve_compile(False, "cuda")
    assert not resolve_compile("auto", "cpu")
    with pytest.MonkeyPatch.context() as mp:
        import torch.utils._triton as triton_probe

        mp.setattr(triton_probe, "has_triton", lambda: True)
        assert resolve_compile("auto", "cuda")
        mp.setattr(triton_probe, "has_triton", lambda: False)
        assert not resolve_compile("auto", "cuda:0")
    with pytest.raises(ConfigError, match="true, false or auto"):
        TrainConfig(compile="yes").validate()
    with pytest.raises(ConfigError, match="true, false or auto"):
        resolve_compile("always", "cpu")
    with pytest.raises(ConfigError, match="train.compile"):
        load_config(None, ["train.compile=sometimes"])
    _, draft = _draft("eagle3")
    assert not compile_draft(draft, "auto", "cpu") and not compiled_regions(draft)
    assert not compile_draft(draft, False) and not compiled_regions(draft)


# ----------------------------------------------------------------------------- the trainer


def _loop_compiles_regions() -> bool:
    from deepspec.train import loop

    return "compile_draft" in inspect.getsource(loop)


@pytest.mark.skipif(not _loop_compiles_regions(), reason="deepspec/train/loop.py does not call compile_draft yet")
def test_auto_is_the_default_once_the_trainer_compiles_regions():
    """Compiling the whole model (the trainer before compile_draft) traced the attention's plans: `auto` may only be
    the default where the trainer compiles regions."""
    from deepspec.config import load_config

    assert load_config(None).train.compile == "auto"


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, tiny_qwen3_dir) -> Path:
    """The EAGLE-3 draft of test_compiled_layers_equal_eager... (target, layers, TTT depth, checkpointing, a trained
    head, 2 rows a micro-batch; 2 micro-batches a step): its regions are the graphs that test compiled, so a new machine
    compiles them once."""
    from tiny_recipe import cached_recipe

    return cached_recipe(tmp_path_factory.mktemp("compile"), tiny_qwen3_dir, samples=8, heldout=2, max_length=96,
                         model="num_draft_layers: 2, ttt_length: 3, activation_checkpointing: true, freeze_lm_head: false",
                         train="optimizer: adamw, global_batch_size: 4, micro_batch_size: 2, max_steps: 3, save_every: 3, "
                               "val_every: 3, log_every: 1, precision: fp32")


@pytest.mark.slow
@pytest.mark.skipif(not _loop_compiles_regions(), reason="deepspec/train/loop.py does not call compile_draft yet")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_train_compile_true_trains_like_eager(recipe, parallel):
    """`train.compile=true` through the trainer (one in-process worker on the CPU): the draft's layer regions run
    compiled, training and validation, and the logged losses are eager's."""
    from deepspec.config import load_config
    from deepspec.train import train
    from deepspec.train.compile import CompiledRegion

    calls = []
    original = CompiledRegion.__call__

    def counting(self, *args):
        calls.append(self.name)
        return original(self, *args)

    def losses(run_dir: Path) -> list[float]:
        return [json.loads(line)["train/loss"] for line in (run_dir / "train_log.jsonl").read_text().splitlines()]

    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        mp.setattr(CompiledRegion, "__call__", counting)
        for setting in ("false", "true"):
            cfg = load_config(recipe, [f"train.compile={setting}", f"train.parallel={parallel}", f"run.name={parallel}-{setting}"])
            train(cfg)
            runs[setting] = (losses(cfg.run_dir), len(calls))
    (eager, eager_calls), (compiled, compiled_calls) = runs["false"], runs["true"]
    assert eager_calls == 0 and compiled_calls > 0
    assert len(eager) == 3 and compiled == pytest.approx(eager, rel=RTOL)


def test_the_torch_versions_whose_inductor_drops_bf16_round_trips():
    """2.11 and 2.12 drop a cast to bf16 and back inside compiled regions whatever emulate_precision_casts says (their
    joint-graph pass; read in their sources), 2.13 keeps it; local version labels (+cpu, +cu130) do not matter."""
    with pytest.MonkeyPatch.context() as mp:
        for version, keeps in [("2.11.0+cu130", False), ("2.12.0", False), ("2.13.0+cpu", True), ("2.14.1", True),
                               ("3.0.0", True)]:
            mp.setattr(torch, "__version__", version)
            assert keeps_bf16_round_trips() is keeps, version
