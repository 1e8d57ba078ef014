"""Taps in the evaluator's decoding loop come from forward hooks (`tap_hooks`, the cache stage's piece), not from
`output_hidden_states`: golden against HF's hidden states for incremental forwards with a KV cache, on a
single-stream and a multi-stream target, both reductions, the embeddings tap included."""

from __future__ import annotations

import pytest
import torch

from deepspec.drafts.base import Proposer
from deepspec.errors import TargetError
from deepspec.eval.decode import generate_speculative, generate_target_only
from deepspec.targets import tiny_target
from deepspec.targets.taps import select_taps, tap_hooks

TAPS = [-1, 0, 2]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["llama", "tiny_mhc"])
def target(request):
    model, _ = tiny_target(request.param, seed=1)
    return request.param, model


def _prefill_then_verify(model, ids: torch.Tensor, split: int, hidden: bool):
    """Two forwards on one DynamicCache, as the evaluator runs them: a prefill of ids[:split], then the rest."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    outs = []
    for part in (ids[:split], ids[split:]):
        outs.append(model(input_ids=part[None], past_key_values=cache, use_cache=True, output_hidden_states=hidden))
    return outs


@pytest.mark.parametrize("reduction", ["mean", "concat"])
def test_hook_taps_equal_output_hidden_states_with_kv_cache(target, reduction):
    """Golden: for a prefill and a 4-token verify forward on a KV cache, the hook taps (forwards without
    output_hidden_states) equal select_taps(output_hidden_states) of the same forwards."""
    family, model = target
    ids = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ref = [select_taps(o.hidden_states, TAPS, reduction) for o in _prefill_then_verify(model, ids, 9, hidden=True)]
        modules = [model.model.embed_tokens, *model.model.layers]
        hooks_before = [len(m._forward_hooks) for m in modules]  # transformers adds its own on output_hidden_states
        got = []
        with tap_hooks(model, TAPS, reduction) as recorder:
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
            for part in (ids[:9], ids[9:]):
                out = model(input_ids=part[None], past_key_values=cache, use_cache=True, output_hidden_states=False)
                assert out.hidden_states is None
                got.append(recorder.stacked())
            with pytest.raises(TargetError, match="No output was caught"):
                recorder.stacked()  # read once: a second read without a forward is refused, never stale
    S, H = model.config.hc_mult if family == "tiny_mhc" else 1, model.config.hidden_size
    width = S * H if reduction == "concat" else H
    assert [tuple(g.shape) for g in got] == [(1, 9, len(TAPS), width), (1, 4, len(TAPS), width)]
    for g, r in zip(got, ref):
        assert torch.allclose(g, r, atol=1e-6, rtol=0), (family, reduction, (g - r).abs().max())
    if S > 1:  # tap -1: the embeddings copied into every stream
        emb = model.model.embed_tokens(ids[9:])[None]
        want = emb if reduction == "mean" else emb.repeat(1, 1, S)
        assert torch.allclose(got[1][:, :, 0], want, atol=1e-6)
    # the hooks are gone after the block
    assert [len(m._forward_hooks) for m in modules] == hooks_before


class _RecordingOracle(Proposer):
    """Drafts the target's greedy continuation (its own cache-free forwards, which also fire the tap hooks),
    misses on purpose at depth 2 every other round, and keeps every tap row the loop hands it."""

    def __init__(self, model):
        self.model, self.rows, self.calls = model, [], 0

    def reset(self):
        self.rows, self.calls = [], 0

    def propose(self, input_ids, new_taps, start, num_tokens, temperature=0.0, generator=None):
        assert new_taps.shape[0] == input_ids.shape[0] - 1 - start
        self.rows.append(new_taps.clone())
        ids, out = input_ids.clone(), []
        for _ in range(num_tokens):
            nxt = self.model(input_ids=ids[None]).logits[0, -1].argmax()
            out.append(int(nxt))
            ids = torch.cat([ids, nxt[None]])
        self.calls += 1
        if self.calls % 2 == 0:
            out[1] = (out[1] + 1) % self.model.config.vocab_size
        toks = torch.tensor(out)
        return toks, torch.nn.functional.one_hot(toks, self.model.config.vocab_size).float()


@pytest.mark.parametrize("reduction", ["mean", "concat"])
def test_decode_loop_hands_the_proposer_full_forward_taps(target, reduction, monkeypatch):
    """generate_speculative: lossless, never asks for output_hidden_states, and the taps the proposer receives
    over all rounds equal one full cache-free forward's taps of the committed tokens (HF hidden states)."""
    family, model = target
    prompt = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(4)).tolist()
    calls = []
    forward = model.forward

    def spy(*args, **kwargs):
        if kwargs.get("past_key_values") is not None:  # the loop's target forwards (the oracle runs without a cache)
            calls.append(kwargs.get("output_hidden_states"))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    proposer = _RecordingOracle(model)
    spec = generate_speculative(model, proposer, TAPS, prompt, max_new_tokens=20, num_draft_tokens=4, tap_reduction=reduction)
    monkeypatch.undo()
    assert spec.tokens == generate_target_only(model, prompt, max_new_tokens=20).tokens
    assert spec.stats.accepted > 0 and spec.stats.accepted < spec.stats.proposed  # accepted drafts and misses both
    assert calls and all(c is False for c in calls)
    received = torch.cat(proposer.rows)  # positions 0 .. (committed before the last round) - 1
    committed = torch.tensor(prompt + spec.tokens)
    with torch.inference_mode():
        full = select_taps(model(committed[None], output_hidden_states=True).hidden_states, TAPS, reduction)
    assert received.shape[0] <= committed.shape[0] - 1
    assert torch.allclose(received, full[0, : received.shape[0]], atol=1e-5), (family, reduction)
