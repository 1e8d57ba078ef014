"""The speculative decoding loop on a tiny random target: lossless at T=0, exact at T>0, seeded."""

from __future__ import annotations

import pytest
import torch

from deepspec.drafts.base import Proposer
from deepspec.eval.decode import eos_token_ids, generate_speculative, generate_target_only
from deepspec.eval.sampling import verify

TAPS = [0, 2, 3]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class OracleProposer(Proposer):
    """Proposes the target's own greedy continuation (recomputed from scratch): must be accepted 100%."""

    def __init__(self, model, break_every: int = 0):
        self.model, self.break_every, self.calls, self.seen_positions = model, break_every, 0, []

    def reset(self):
        self.calls, self.seen_positions = 0, []

    def propose(self, input_ids, new_taps, start, num_tokens, temperature=0.0, generator=None):
        # contract: new taps cover positions start..L-2
        assert new_taps.shape[0] == input_ids.shape[0] - 1 - start, (new_taps.shape, input_ids.shape, start)
        self.seen_positions.append((start, input_ids.shape[0] - 1))
        ids = input_ids.clone()
        out = []
        for _ in range(num_tokens):
            nxt = self.model(input_ids=ids[None]).logits[0, -1].argmax()
            out.append(int(nxt))
            ids = torch.cat([ids, nxt[None]])
        self.calls += 1
        if self.break_every and self.calls % self.break_every == 0:
            out[1] = (out[1] + 1) % self.model.config.vocab_size  # a deliberate miss at depth 2
        toks = torch.tensor(out)
        return toks, torch.nn.functional.one_hot(toks, self.model.config.vocab_size).float()


class RandomProposer(Proposer):
    """Uniformly random drafts (q = uniform): almost all rejected, output must still be the target's."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.g = vocab, torch.Generator().manual_seed(seed)

    def reset(self):
        pass

    def propose(self, input_ids, new_taps, start, num_tokens, temperature=0.0, generator=None):
        toks = torch.randint(0, self.vocab, (num_tokens,), generator=self.g)
        return toks, torch.full((num_tokens, self.vocab), 1.0 / self.vocab)


@pytest.fixture(scope="module")
def tiny():
    from deepspec.targets import tiny_target

    model, tok = tiny_target("llama", seed=3)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=True)
    if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
        prompt = prompt["input_ids"]
    return model, tok, list(prompt)


def _hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_target_only_matches_hf_generate(tiny):
    model, _, prompt = tiny
    gen = generate_target_only(model, prompt, max_new_tokens=24)
    assert gen.tokens == _hf_greedy(model, prompt, 24)


@pytest.mark.parametrize("break_every", [0, 2])
def test_oracle_proposer_lossless_and_accepted(tiny, break_every):
    model, _, prompt = tiny
    prop = OracleProposer(model, break_every)
    gen = generate_speculative(model, prop, TAPS, prompt, max_new_tokens=30, num_draft_tokens=4)
    assert gen.tokens == _hf_greedy(model, prompt, 30)
    s = gen.stats
    assert s.generated == len(gen.tokens) - 1  # the prefill token is not a verify round
    if break_every == 0:
        assert s.acc_cond(1) == 1.0 and s.acc_cond(4) == 1.0
        # full rounds give 5 tokens each; the last one may be truncated by max_new_tokens
        assert s.tau == 5.0
    else:
        # every second round misses at depth 2: those rounds accept exactly 1 draft
        assert s.acc_cond(1) == 1.0 and s.acc_cond(2) < 1.0
        assert s.accepted_at[1] == s.reached[1] - (s.rounds // 2)
    # the proposer saw every committed position exactly once, in order
    spans = prop.seen_positions
    assert spans[0][0] == 0 and all(b[0] == a[1] for a, b in zip(spans, spans[1:]))


def test_random_proposer_lossless(tiny):
    model, _, prompt = tiny
    gen = generate_speculative(model, RandomProposer(model.config.vocab_size), TAPS, prompt, max_new_tokens=20, num_draft_tokens=3)
    assert gen.tokens == _hf_greedy(model, prompt, 20)
    assert gen.stats.tau < 1.5


def test_eos_stops_inside_accepted_drafts(tiny):
    model, _, prompt = tiny
    greedy = _hf_greedy(model, prompt, 12)
    eos = greedy[5]  # pretend the 6th greedy token is EOS: generation must end right there
    gen = generate_speculative(model, OracleProposer(model), TAPS, prompt, max_new_tokens=40, num_draft_tokens=4, eos_ids={eos})
    assert gen.tokens == greedy[: greedy.index(eos) + 1] and gen.stopped_by_eos
    base = generate_target_only(model, prompt, max_new_tokens=40, eos_ids={eos})
    assert base.tokens == gen.tokens


def test_sampling_is_seeded(tiny):
    model, _, prompt = tiny
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(7)
        runs.append(
            generate_speculative(model, RandomProposer(model.config.vocab_size, 1), TAPS, prompt,
                                 max_new_tokens=15, num_draft_tokens=3, temperature=1.0, generator=g).tokens
        )
    assert runs[0] == runs[1]


def test_eos_ids_collects_generation_config(tiny):
    model, tok, _ = tiny
    assert 258 in eos_token_ids(model, tok)


# ---------------------------------------------------------------------------------- exactness of sampling


def _toy_two_step(V=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    p1 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    p2 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)  # p2[x1] = target's next distribution
    p3 = torch.softmax(torch.randn(V, V, generator=g), -1)
    # a deliberately different draft, with a zero entry (the residual must cover it)
    q1 = torch.softmax(torch.randn(V, generator=g) * 2.0, -1)
    q1[0] = 0
    q1 /= q1.sum()
    q2 = torch.softmax(torch.randn(V, V, generator=g) * 2.0, -1)
    return p1, p2, p3, q1, q2


@pytest.mark.slow
def test_rejection_sampling_reproduces_target_joint_distribution():
    """Chi-square test over the 16 outcomes of the first two emitted tokens (2 drafts per round, 2 rounds max)."""
    V, N = 4, 12000
    p1, p2, p3, q1, q2 = _toy_two_step(V)
    g = torch.Generator().manual_seed(123)
    counts = torch.zeros(V, V)
    accepted_first = 0
    for _ in range(N):
        d1 = int(torch.multinomial(q1, 1, generator=g))
        d2 = int(torch.multinomial(q2[d1], 1, generator=g))
        logits = torch.stack([p1.log(), p2[d1].log(), p3[d2].log()])
        n, emitted = verify(torch.tensor([d1, d2]), torch.stack([q1, q2[d1]]), logits, 1.0, g)
        out = [d1, d2][:n] + [emitted]
        accepted_first += n >= 1
        if len(out) == 1:  # second token comes from the next round: one draft from q2, verified against p2
            x1 = out[0]
            d = int(torch.multinomial(q2[x1], 1, generator=g))
            m, e = verify(torch.tensor([d]), q2[x1][None], torch.stack([p2[x1].log(), p3[d].log()]), 1.0, g)
            out += [d][:m] + [e]
        counts[out[0], out[1]] += 1
    expected = (p1[:, None] * p2) * N
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 15 degrees of freedom: P(chi2 > 37.7) = 0.001
    assert chi2 < 37.7, (chi2, counts, expected)
    # and the draft really differed from the target (otherwise the test proves nothing)
    assert 0.2 < accepted_first / N < 0.95


def test_biased_verifier_is_detected():
    """Sanity check of the test's power: accepting every draft (no rejection) fails the same chi-square."""
    V, N = 4, 12000
    p1, p2, _, q1, _ = _toy_two_step(V)
    g = torch.Generator().manual_seed(5)
    draws = torch.multinomial(q1, N, replacement=True, generator=g)
    counts = torch.bincount(draws, minlength=V).float()
    chi2 = float(((counts - p1 * N) ** 2 / (p1 * N)).sum())
    assert chi2 > 37.7


def test_verify_greedy_counts_prefix():
    logits = torch.full((4, 5), -10.0)
    for i, t in enumerate([1, 2, 3, 4]):
        logits[i, t] = 0
    assert verify(torch.tensor([1, 2, 0]), None, logits, 0.0) == (2, 3)
    assert verify(torch.tensor([1, 2, 3]), None, logits, 0.0) == (3, 4)
    assert verify(torch.tensor([0, 2, 3]), None, logits, 0.0) == (0, 1)
    assert verify(torch.tensor([], dtype=torch.long), None, logits[:1], 0.0) == (0, 1)
