"""Sequence packing: a packed micro-batch gives the same losses, metrics and gradients as the padded one
(fp32) for every draft, and the packing collate keeps padding under 5%."""

from __future__ import annotations

import random

import pytest
import torch

from deepspec.config.model import ModelConfig
from deepspec.config.train import TrainConfig
from deepspec.drafts import get_algorithm
from deepspec.drafts.checkpoint import target_weights
from deepspec.errors import ConfigError
from deepspec.targets import capture, tiny_target
from deepspec.data.batches import collate_features, pack_batch, pack_features, pack_layout, packing

LENGTHS = [11, 17, 6, 9]


def _samples(model, taps_ids, lengths=LENGTHS):
    out = []
    g = torch.Generator().manual_seed(3)
    for i, n in enumerate(lengths):
        ids = torch.randint(0, 250, (1, n), generator=g)
        taps, final = capture(model, ids, taps_ids)
        lm = torch.ones(n, dtype=torch.bool)
        lm[: 2 + i] = False  # a prompt of varying length
        out.append({"input_ids": ids[0], "loss_mask": lm, "taps": taps[0], "final_hidden": final[0]})
    return out


def _draft(algorithm: str, **kw):
    torch.manual_seed(0)
    model, _ = tiny_target("qwen3" if algorithm != "eagle3" else "llama")
    cfg = ModelConfig(algorithm=algorithm, target_layer_ids=[0, 2, 4], block_size=4, num_anchors=3, markov_rank=8, ttt_length=4, **kw)
    draft = get_algorithm(algorithm).from_target_config(model.config, cfg)
    draft.load_target_weights(*target_weights(model))
    if algorithm == "dspark":
        torch.nn.init.normal_(draft.markov_head.markov_w2.weight, std=0.5)
    return model, draft


def _run(draft, batch, **kw):
    draft.zero_grad()
    loss, metrics = draft.loss(batch, **kw)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    return loss.detach(), metrics, grads


def _same(a, b):
    (la, ma, ga), (lb, mb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        err, scale = float((ga[n] - gb[n]).abs().max()), float(gb[n].abs().max())
        assert err <= 1e-5 * scale + 1e-6, f"{n}: {err} at scale {scale}"
    assert ma.keys() == mb.keys()
    for k in ma:
        for x, y in zip(ma[k], mb[k]):
            torch.testing.assert_close(x.float(), y.float(), rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"num_draft_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}])
def test_eagle3_packed_equals_padded(kw):
    model, draft = _draft("eagle3", **kw)
    items = _samples(model, draft.taps)
    padded = collate_features(items)
    packed = pack_batch(padded, pack_tokens=24)
    assert packed.input_ids.shape[0] < len(items) and packed.segment_ids is not None
    draft.train()
    _same(_run(draft, packed), _run(draft, padded))
    # per-sample: each sample alone gives the loss its segment gives inside the packed row (label shifts
    # never read the next sample)
    one = _run(draft, pack_batch(collate_features(items[:1] + items[2:3]), pack_tokens=1000))
    two = _run(draft, collate_features(items[:1] + items[2:3]))
    _same(one, two)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
@pytest.mark.parametrize("kw", [{}, {"layer_types": ["sliding_attention"], "sliding_window": 4}])
def test_block_packed_equals_padded(algorithm, kw):
    model, draft = _draft(algorithm, **kw)
    items = _samples(model, draft.taps)
    padded = collate_features(items)
    layout = pack_layout(LENGTHS, 24)
    packed = pack_batch(padded, pack_tokens=24)
    # the same blocks in both layouts: anchors per sample, shifted to their packed rows
    per_sample = [[3, 5, 8], [4, 10, 14], [2, 3, 0], [5, 6, 7]]
    keep_s = [[True, True, True], [True, True, True], [True, True, False], [True, True, True]]
    anchors_p = torch.tensor(per_sample)
    keep_p = torch.tensor(keep_s)
    rows_a, rows_k = [], []
    for row in layout:
        at, a, k = 0, [], []
        for i in row:
            a += [at + x for x in per_sample[i]]
            k += keep_s[i]
            at += LENGTHS[i]
        rows_a.append(a)
        rows_k.append(k)
    width = max(len(a) for a in rows_a)
    anchors_q = torch.tensor([a + [0] * (width - len(a)) for a in rows_a])
    keep_q = torch.tensor([k + [False] * (width - len(k)) for k in rows_k])
    order = anchors_q.masked_fill(~keep_q, 10**6).argsort(1)
    anchors_q, keep_q = anchors_q.gather(1, order), keep_q.gather(1, order)
    draft.train()
    a = _run(draft, packed, anchors=anchors_q, keep=keep_q)
    b = _run(draft, padded, anchors=anchors_p, keep=keep_p)
    a[1].pop("anchors"), b[1].pop("anchors")  # anchors per row: rows differ by construction
    _same(a, b)


def _valid_anchor_counts(items):
    """Per sample: positions a with loss_mask[a] & loss_mask[a+1] (the anchors a block draft may use)."""
    return [int((it["loss_mask"][:-1] & it["loss_mask"][1:]).sum()) for it in items]


def _anchors_by_sample(batch, anchors, keep, layout=None):
    """{sample index: sorted in-sample anchor positions} from a padded (layout None) or packed batch."""
    out = {}
    for r in range(anchors.shape[0]):
        for a in anchors[r][keep[r]].tolist():
            if layout is None:
                i, pos = r, a
            else:
                i, pos = layout[r][int(batch.segment_ids[r, a])], int(batch.position_ids[r, a])
            out.setdefault(i, []).append(pos)
    return {i: sorted(v) for i, v in out.items()}


@pytest.mark.slow
@pytest.mark.parametrize("training", [True, False])
def test_block_anchors_per_sample_through_the_sampler(training):
    """The real sampler gives every sample min(num_anchors, valid_i) anchors, packed or padded (a 200-token and a
    10-token sample in one row: 8 and 6 here, not ~15 and ~1 as a per-row draw gives), and the same anchors in
    both layouts under the same seed."""
    lengths = [200, 10, 37, 8, 64, 3]
    model, draft = _draft("dflash")
    draft.model_cfg.num_anchors = 8
    items = _samples(model, draft.taps, lengths)
    want = [min(8, n) for n in _valid_anchor_counts(items)]
    assert want == [8, 6, 8, 2, 8, 0]
    padded = collate_features(items)
    layout = pack_layout(lengths, 256)
    packed = pack_batch(padded, pack_tokens=256)
    assert any(len(row) > 1 for row in layout) and packed.input_ids.shape[0] == len(layout)
    draft.train(training)
    for seed in range(5):
        torch.manual_seed(seed)
        got_packed = _anchors_by_sample(packed, *draft.sample_anchors(packed.loss_mask, packed.attention_mask, packed.segment_ids, packed.input_ids), layout)
        torch.manual_seed(seed)
        got_padded = _anchors_by_sample(padded, *draft.sample_anchors(padded.loss_mask, padded.attention_mask, None, padded.input_ids))
        assert [len(got_packed.get(i, [])) for i in range(len(lengths))] == want
        assert got_packed == got_padded
        for i, pos in got_padded.items():  # each anchor and its next token are supervised tokens of the sample
            assert all(bool(items[i]["loss_mask"][a]) and bool(items[i]["loss_mask"][a + 1]) for a in pos)
    torch.manual_seed(0)
    first = draft.sample_anchors(padded.loss_mask, padded.attention_mask, None, padded.input_ids)
    torch.manual_seed(1)
    second = draft.sample_anchors(padded.loss_mask, padded.attention_mask, None, padded.input_ids)
    assert torch.equal(first[0], second[0]) != training  # fresh draws per step; validation's draw is fixed


def test_block_anchor_draw_is_uniform_within_a_sample():
    """Over many draws each valid position of a sample is an anchor about num_anchors / valid_i of the time."""
    from deepspec.drafts.anchors import sample_anchors

    n, k, draws = 120, 6, 1500
    ids = torch.randint(0, 250, (1, n), generator=torch.Generator().manual_seed(0))
    lm = torch.ones(1, n, dtype=torch.bool)
    hits = torch.zeros(n)
    torch.manual_seed(0)
    for _ in range(draws):
        a, keep = sample_anchors(lm, lm, k, None, ids)
        assert int(keep.sum()) == k
        hits[a[keep]] += 1
    assert hits[-1] == 0  # the last token has no next token to predict
    expect = draws * k / (n - 1)  # 75.6 per position, binomial sd ~8.5
    assert float(hits[:-1].min()) > expect - 35 and float(hits[:-1].max()) < expect + 35


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
@pytest.mark.parametrize("kw", [{}, {"layer_types": ["sliding_attention"], "sliding_window": 4}])
def test_block_packed_equals_padded_with_sampled_anchors(algorithm, kw):
    """No injected anchors: draft.loss draws them itself, and the packed batch gives the padded batch's loss, metrics
    (anchors per sample included) and gradients, in training and in validation."""
    model, draft = _draft(algorithm, **kw)
    items = _samples(model, draft.taps)
    assert max(_valid_anchor_counts(items)) > draft.model_cfg.num_anchors  # the draw has a choice to make
    padded = collate_features(items)
    packed = pack_batch(padded, pack_tokens=24)
    assert packed.input_ids.shape[0] < len(items)
    for training in (True, False):
        draft.train(training)
        torch.manual_seed(7)
        a = _run(draft, packed)
        torch.manual_seed(7)
        b = _run(draft, padded)
        _same(a, b)
        want = sum(min(draft.model_cfg.num_anchors, n) for n in _valid_anchor_counts(items)) / len(items)
        assert float(b[1]["anchors"][0] / b[1]["anchors"][1]) == pytest.approx(want)


def test_packed_anchors_stay_in_their_sample():
    model, draft = _draft("dflash")
    items = _samples(model, draft.taps)
    packed = pack_batch(collate_features(items), pack_tokens=24)
    draft.train()
    anchors, keep = draft.sample_anchors(packed.loss_mask, packed.attention_mask, packed.segment_ids)
    seg = packed.segment_ids
    a_seg = seg.gather(1, anchors)
    nxt = seg.gather(1, (anchors + 1).clamp(max=seg.shape[1] - 1))
    assert bool(((a_seg == nxt) & (a_seg >= 0))[keep].all())


@pytest.mark.parametrize("micro", [1, 2, 3, 8, 32])
def test_pack_layout_padding_under_five_percent(micro):
    rng = random.Random(micro)
    for _ in range(20):
        lengths = [rng.randint(20, 1024) for _ in range(micro)]
        layout = pack_layout(lengths, 2048)
        assert sorted(i for row in layout for i in row) == list(range(micro))
        width = max(sum(lengths[i] for i in row) for row in layout)
        padding = len(layout) * width - sum(lengths)
        assert padding < 0.05 * len(layout) * width


def test_packing_collate_and_config():
    model, draft = _draft("eagle3")
    items = _samples(model, draft.taps)
    assert packing(collate_features, 0) is collate_features
    batch = packing(collate_features, 64)(items)
    assert batch.input_ids.shape == (1, sum(LENGTHS))
    assert batch.position_ids[0, : LENGTHS[0] + 1].tolist() == list(range(LENGTHS[0])) + [0]
    with pytest.raises(ConfigError, match="pack_tokens"):
        TrainConfig(pack_tokens=-1).validate()


def test_training_loop_with_packing_logs_the_padded_runs_losses(tmp_path, tiny_llama_dir, monkeypatch):
    """train.pack_tokens through the real loop: EAGLE-3's per-step losses equal the unpacked run's (same samples)."""
    import json
    from pathlib import Path

    from deepspec.config import load_config
    from deepspec.data.cache import build_cache
    from deepspec.train import train

    repo = Path(__file__).resolve().parents[1]
    rng = random.Random(0)
    words = "the cat sat on a mat and then ran far away from home while it rained all day long".split()
    data = tmp_path / "data"
    data.mkdir()
    rows = []
    for i in range(16):
        q = " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))
        a = " ".join(rng.choice(words) for _ in range(rng.randint(6, 30)))
        rows.append(json.dumps({"id": str(i), "conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}))
    (data / "regenerated.jsonl").write_text("\n".join(rows) + "\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"""_base_: {repo}/config/quickstart/eagle3.yaml
project: t
exp: pack
output_root: {tmp_path}/out
target: {{name: {tiny_llama_dir}, dtype: float32}}
data: {{dir: {data}}}
cache: {{max_length: 128}}
model: {{target_layer_ids: [0, 2, 4], draft_vocab_size: null, init_copy_heads: false}}
train: {{output_root: {tmp_path}/ckpt, optimizer: adamw, precision: fp32, global_batch_size: 8, micro_batch_size: 4, max_steps: 2,
         save_every: 100, val_every: 100, log_every: 1, num_workers: 0}}
logging: {{progress: false, wandb: false, tensorboard: false}}
"""
    )
    build_cache(load_config(recipe), "train")
    import deepspec.data.batches as batches

    packed_rows = []

    real_pack = batches._pack  # what both packing paths (from the samples, from a padded batch) end in

    def counting(layout, lengths, sources, pin):
        packed_rows.append((len(lengths), len(layout)))
        return real_pack(layout, lengths, sources, pin)

    monkeypatch.setattr(batches, "_pack", counting)
    losses = {}
    for pack in (0, 96):
        cfg = load_config(recipe, [f"train.pack_tokens={pack}", f"exp=pack{pack}"])
        train(cfg)
        log = [json.loads(x) for x in (cfg.run_dir / "train_log.jsonl").read_text().splitlines()]
        losses[pack] = [r["train/loss"] for r in log]
    assert len(losses[0]) == 2
    assert len(packed_rows) == 4 and any(rows < samples for samples, rows in packed_rows)  # 2 steps x 2 micro-batches
    assert losses[96] == pytest.approx(losses[0], rel=1e-5)


def _reference_pack_batch(batch, pack_tokens):
    """pack_batch as it was before it packed into one buffer (zero-filled tensors, then the samples copied in):
    the golden output the one-copy packing must reproduce bit for bit."""
    from deepspec.drafts.base import DraftBatch

    lengths = [int(n) for n in batch.attention_mask.sum(1).tolist()]
    layout = pack_layout(lengths, pack_tokens)
    width = max(sum(lengths[i] for i in row) for row in layout)
    rows_n = len(layout)
    names = ["input_ids", "loss_mask", "attention_mask", "taps", "final_hidden"]
    names += [k for k in ("taps_scale", "final_scale") if getattr(batch, k) is not None]
    out = {k: torch.zeros((rows_n, width, *getattr(batch, k).shape[2:]), dtype=getattr(batch, k).dtype) for k in names}
    pos = torch.zeros(rows_n, width, dtype=torch.long)
    seg = torch.full((rows_n, width), -1, dtype=torch.long)
    for r, row in enumerate(layout):
        at = 0
        for j, i in enumerate(row):
            n = lengths[i]
            for k in names:
                out[k][r, at : at + n] = getattr(batch, k)[i, :n]
            pos[r, at : at + n] = torch.arange(n)
            seg[r, at : at + n] = j
            at += n
    return DraftBatch(**out, position_ids=pos, segment_ids=seg)


def _random_items(g, kind, n_samples):
    """Cache-like samples: bf16 / fp32 features, or fp8 with per-row scales (2 streams per tap, concatenated)."""
    items = []
    for _ in range(n_samples):
        t = int(torch.randint(1, 40, (), generator=g))
        it = {"input_ids": torch.randint(0, 1000, (t,), generator=g), "loss_mask": torch.rand(t, generator=g) > 0.4}
        if kind == "fp8":
            it["taps"] = (torch.randn(t, 3, 2 * 8, generator=g) * 50).to(torch.float8_e4m3fn)
            it["taps_scale"] = torch.rand(t, 3, 2, generator=g)
            it["final_hidden"] = (torch.randn(t, 8, generator=g) * 50).to(torch.float8_e4m3fn)
            it["final_scale"] = torch.rand(t, generator=g)
        else:
            dtype = torch.bfloat16 if kind == "bf16" else torch.float32
            it["taps"] = torch.randn(t, 3, 8, generator=g).to(dtype)
            it["final_hidden"] = torch.randn(t, 8, generator=g).to(dtype)
        items.append(it)
    return items


def _bits(x):
    return x.view(torch.uint8) if x.dtype.itemsize == 1 and x.is_floating_point() else x


def _assert_identical(a, b):
    from dataclasses import fields

    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
            assert x == y, f.name
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, f.name
        assert torch.equal(_bits(x), _bits(y)), f.name


@pytest.mark.parametrize("kind", ["bf16", "fp32", "fp8"])
def test_one_copy_packing_equals_the_reference_bit_for_bit(kind):
    """pack_batch (from a padded batch) and pack_features / packing (straight from the samples) give exactly the
    tensors of the reference packing, over random batches, buffers recycled between them (the stale bytes of the
    previous batch must never show through the padding)."""
    from deepspec.data.buffers import POOL

    POOL.clear()
    g = torch.Generator().manual_seed({"bf16": 0, "fp32": 1, "fp8": 2}[kind])
    recycled = 0
    seen_ptrs = set()
    for trial in range(30):
        items = _random_items(g, kind, int(torch.randint(1, 9, (), generator=g)))
        pack_tokens = int(torch.randint(1, 120, (), generator=g))
        padded = collate_features(items, pad_to_multiple_of=[1, 8][trial % 2])
        want = _reference_pack_batch(padded, pack_tokens)
        for got in (pack_batch(padded, pack_tokens), pack_features(items, pack_tokens), packing(collate_features, pack_tokens)(items)):
            _assert_identical(got, want)
            recycled += got.taps.data_ptr() in seen_ptrs
            seen_ptrs.add(got.taps.data_ptr())
            del got
    assert recycled > 10  # the comparison did run on reused buffers


def test_packing_rejects_what_it_would_silently_mistrain_on():
    from deepspec.errors import CacheError, DataError

    g = torch.Generator().manual_seed(5)
    items = _random_items(g, "bf16", 3)
    batch = collate_features(items)
    left = torch.zeros_like(batch.attention_mask)
    n = int(batch.attention_mask[0].sum())
    left[0, batch.attention_mask.shape[1] - n :] = True  # row 0 left-padded
    left[1:] = batch.attention_mask[1:]
    import dataclasses

    with pytest.raises(DataError, match="right-padded"):
        pack_batch(dataclasses.replace(batch, attention_mask=left), 64)
    bad = [dict(it) for it in items]
    bad[1]["final_hidden"] = bad[1]["final_hidden"][:1]  # one row would broadcast over all of the sample's tokens
    with pytest.raises(CacheError, match="rows of 'final_hidden'"):
        pack_features(bad, 64)
    with pytest.raises(CacheError, match="rows of 'final_hidden'"):
        collate_features(bad)
