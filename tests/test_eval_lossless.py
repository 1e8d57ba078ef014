"""Greedy losslessness of every draft algorithm on tiny random targets (Llama and Qwen3 families).

Random drafts are accepted rarely; what matters is that the speculative output equals the target's
own greedy output (HF `generate`) token for token, in fp32, and that the proposer's contract holds
across many accept/reject rounds. Algorithms whose module has not landed yet are skipped by name.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deepspec.drafts.registry import available_algorithms

ALGOS = available_algorithms()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _algorithm(name):
    from deepspec.drafts.registry import _MODULES, get_algorithm

    if importlib.util.find_spec(_MODULES[name]) is None:
        pytest.skip(f"draft algorithm {name} is not implemented yet ({_MODULES[name]} missing)")
    return get_algorithm(name)


def _random_draft(name, model, **model_kw):
    from deepspec.config.model import ModelConfig

    cls = _algorithm(name)
    torch.manual_seed(0)
    draft = cls.from_target_config(model.config, ModelConfig(algorithm=name, **model_kw))
    draft.load_target_weights(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return draft.float().eval()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("algo", ALGOS)
def test_greedy_lossless(algo, family):
    from deepspec.eval.decode import generate_speculative, generate_target_only
    from deepspec.targets import tiny_target

    model, tok = tiny_target(family, seed=1)
    draft = _random_draft(algo, model, block_size=4, ttt_length=4)
    prompt = list(tok("<|im_start|>user\nCount with me: one two three<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
    n = 40
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    spec = generate_speculative(model, draft.proposer(), draft.taps, prompt, max_new_tokens=n, num_draft_tokens=4)
    assert spec.tokens == ref
    assert generate_target_only(model, prompt, max_new_tokens=n).tokens == ref
    s = spec.stats
    assert s.rounds >= 1 and s.generated == n - 1 and s.proposed >= s.rounds
    # the proposer's state survives a reset: a second answer is lossless too
    spec2 = generate_speculative(model, draft.proposer(), draft.taps, prompt[:-3], max_new_tokens=10, num_draft_tokens=3)
    ref2 = model.generate(torch.tensor([prompt[:-3]]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt) - 3:].tolist()
    assert spec2.tokens == ref2


@pytest.mark.parametrize("method", ["probabilistic", "greedy"])
@pytest.mark.parametrize("algo", ALGOS)
def test_self_draft_is_accepted(algo, method):
    """Sampled decoding (T=1) with every algorithm's real proposer runs under both draft-sampling protocols and is
    reproducible with a seed; under `greedy` the proposer drafts its argmax (the target-distribution checks of both
    protocols are in tests/test_eval_protocols.py)."""
    from deepspec.eval.decode import generate_speculative
    from deepspec.targets import tiny_target

    model, tok = tiny_target("llama", seed=2)
    draft = _random_draft(algo, model, block_size=3, ttt_length=3)
    prompt = list(tok("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
    outs = [
        generate_speculative(model, draft.proposer(), draft.taps, prompt, max_new_tokens=16, num_draft_tokens=3,
                             temperature=1.0, generator=torch.Generator().manual_seed(11), draft_sample_method=method).tokens
        for _ in range(2)
    ]
    assert outs[0] == outs[1] and len(outs[0]) == 16
    if method == "greedy":  # the drafts are the proposer's T=0 drafts, whatever the target samples
        prop = draft.proposer()
        calls = []
        real = prop.propose

        def spy(*a, **kw):
            calls.append(kw.get("temperature"))
            return real(*a, **kw)

        prop.propose = spy
        generate_speculative(model, prop, draft.taps, prompt, max_new_tokens=6, num_draft_tokens=3, temperature=1.0,
                             generator=torch.Generator().manual_seed(1), draft_sample_method="greedy")
        assert calls and set(calls) == {0.0}
