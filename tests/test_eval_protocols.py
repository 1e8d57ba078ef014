"""Draft-sampling protocols at T > 0 (eval/sampling.py): `probabilistic` (drafts sampled from the draft's softmax, the
papers' protocol) and `greedy` (argmax drafts, vLLM's default rule). Both lossless; an oracle draft (q = p_target)
is accepted always under the first and with probability max p under the second."""

from __future__ import annotations

import math

import pytest
import torch

from deepspec.drafts.base import Proposer
from deepspec.eval.sampling import draft_temperature, protocol_name, verify

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHI2_15DOF_P001 = 37.7  # P(chi2 > 37.7) = 0.001 with 15 degrees of freedom


def _toy_two_step(V: int = 4):
    g = torch.Generator().manual_seed(7)
    p1 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    p2 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)  # p2[x1] = the target's next distribution
    p3 = torch.softmax(torch.randn(V, V, generator=g), -1)
    # a deterministic draft that differs from the target's argmax in some contexts
    d1 = int((p1 + torch.tensor([0.0, 0.3, 0.0, 0.0][:V])).argmax())
    d2 = torch.softmax(torch.randn(V, V, generator=g) * 2.0, -1).argmax(-1)  # d2[x1]
    return p1, p2, p3, d1, d2


def _emit_two(p1, p2, p3, d1, d2, g, verifier) -> tuple[list[int], int]:
    """The first two tokens of speculative sampling with greedy drafts (2 per round), and drafts accepted in round 1."""
    a, b = d1, int(d2[d1])
    logits = torch.stack([p1.log(), p2[a].log(), p3[b].log()])
    n, emitted = verifier(torch.tensor([a, b]), logits, g)
    out = [a, b][:n] + [emitted]
    if len(out) == 1:  # the second token comes from the next round: one greedy draft verified against p2[x1]
        x1 = out[0]
        d = int(d2[x1])
        m, e = verifier(torch.tensor([d]), torch.stack([p2[x1].log(), p3[d].log()]), g)
        out += [d][:m] + [e]
    return out[:2], n


def _chi2_two_tokens(verifier, N: int = 4000, seed: int = 123) -> tuple[float, float]:
    V = 4
    p1, p2, p3, d1, d2 = _toy_two_step(V)
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    accepted_first = 0
    for _ in range(N):
        out, n = _emit_two(p1, p2, p3, d1, d2, g, verifier)
        counts[out[0], out[1]] += 1
        accepted_first += n >= 1
    expected = (p1[:, None] * p2) * N
    return float(((counts - expected) ** 2 / expected).sum()), accepted_first / N


def test_greedy_drafts_reproduce_target_joint_distribution():
    """Lossless under the greedy protocol: the first two emitted tokens follow the target's joint distribution."""
    chi2, acc = _chi2_two_tokens(lambda d, logits, g: verify(d, None, logits, 1.0, g, method="greedy"))
    assert chi2 < CHI2_15DOF_P001, chi2
    assert 0.2 < acc < 0.95  # the drafts were really rejected sometimes (otherwise the test proves nothing)


def test_greedy_protocol_chi2_detects_a_wrong_recovery():
    """The test's power: resampling the rejected position from p itself (the rejected token's mass not removed)
    is biased toward the draft, and the same chi-square catches it."""

    def wrong(d, logits, g):
        n, _ = verify(d, None, logits, 1.0, g, method="greedy")
        return n, int(torch.multinomial(logits[n].softmax(-1), 1, generator=g))  # p itself, draft included

    chi2, _ = _chi2_two_tokens(wrong, seed=5)
    assert chi2 > CHI2_15DOF_P001, chi2


def test_greedy_rule_matches_vllm_kernel():
    """vLLM 0.32 without draft probs: accept x iff p(x) >= u; on rejection draw from p with x zeroed. Checked
    statistically per position on a fixed p: acceptance frequency = p(x), the recovered token never x and
    distributed as p without x."""
    V, N = 5, 8000
    p = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10])
    logits = torch.stack([p.log(), p.log()])
    g = torch.Generator().manual_seed(3)
    acc, rec = 0, torch.zeros(V)
    for _ in range(N):
        n, e = verify(torch.tensor([2]), None, logits, 1.0, g, method="greedy")
        acc += n
        if n == 0:
            rec[e] += 1
    sigma = math.sqrt(N * 0.25 * 0.75)
    assert abs(acc - N * 0.25) < 4 * sigma, acc
    assert rec[2] == 0
    want = p.clone()
    want[2] = 0
    want = want / want.sum() * rec.sum()
    chi2 = float(((rec - want)[want > 0] ** 2 / want[want > 0]).sum())
    assert chi2 < 18.5, (chi2, rec, want)  # 3 dof, P = 0.0003
    # a draft the target gives no mass is never accepted
    zero = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0]).log()
    assert all(verify(torch.tensor([0]), None, torch.stack([zero, zero]), 1.0, g, method="greedy")[0] == 0 for _ in range(200))


def test_protocols_coincide_at_t0_and_names():
    logits = torch.full((3, 5), -10.0)
    logits[0, 1] = logits[1, 2] = logits[2, 4] = 0
    for method in ("probabilistic", "greedy"):
        assert verify(torch.tensor([1, 3]), None, logits, 0.0, method=method) == (1, 2)
        assert draft_temperature(0.0, method) == 0.0
    assert draft_temperature(0.7, "probabilistic") == 0.7 and draft_temperature(0.7, "greedy") == 0.0
    assert protocol_name(0.0, "greedy") == protocol_name(0.0, "probabilistic") == "greedy (T=0)"
    assert protocol_name(1.0, "greedy") == "greedy drafts, T=1"
    with pytest.raises(ValueError):
        draft_temperature(1.0, "topk")


# ----------------------------------------------------------------------------------------- oracle q = p_target


def test_oracle_acceptance_per_round_statistics():
    """Many independent rounds on random target distributions with max p spread over (0, 1): an oracle draft
    (q = p) is always accepted under `probabilistic` and accepted with probability max p under `greedy`."""
    V, N = 16, 4000
    g = torch.Generator().manual_seed(11)
    scale = torch.rand(N, 1, generator=g) * 4.0
    target = torch.randn(N, 2, V, generator=g) * scale[..., None]  # row 0: before the draft, row 1: the bonus
    p = target[:, 0].softmax(-1)
    prob_acc = greedy_acc = 0
    for i in range(N):
        x = torch.multinomial(p[i], 1, generator=g)
        prob_acc += verify(x, p[i][None], target[i], 1.0, g, method="probabilistic")[0]
        greedy_acc += verify(p[i].argmax()[None], None, target[i], 1.0, g, method="greedy")[0]
    m = p.max(-1).values.double()
    expected, sigma = float(m.sum()), float((m * (1 - m)).sum().sqrt())
    assert prob_acc == N
    assert abs(greedy_acc - expected) < 4 * sigma, (greedy_acc, expected, sigma)
    assert N - expected > 20 * sigma  # the two protocols are far apart here: neither check can pass for the other


class TargetOracle(Proposer):
    """Drafts from the target itself: at temperature T it samples the target's softmax(z / T) (q = p_target), at
    temperature 0 it takes the argmax. Records max p (at `ref_temperature`) of each round's first draft."""

    def __init__(self, model, ref_temperature: float):
        self.model, self.ref_t = model, ref_temperature
        self.first_max_p: list[float] = []

    def reset(self):
        self.first_max_p = []

    def propose(self, input_ids, new_taps, start, num_tokens, temperature=0.0, generator=None):
        ids = input_ids.clone()
        toks, probs = [], []
        for j in range(num_tokens):
            z = self.model(input_ids=ids[None]).logits[0, -1].float()
            if j == 0:
                self.first_max_p.append(float(torch.softmax(z / self.ref_t, -1).max()))
            if temperature > 0:
                q = torch.softmax(z / temperature, -1)
                tok = int(torch.multinomial(q, 1, generator=generator))
            else:
                tok = int(z.argmax())
                q = torch.nn.functional.one_hot(torch.tensor(tok), z.numel()).float()
            toks.append(tok)
            probs.append(q)
            ids = torch.cat([ids, torch.tensor([tok])])
        return torch.tensor(toks), torch.stack(probs)


@pytest.fixture(scope="module")
def sharp_tiny():
    """A tiny random target whose LM head is scaled so its T=1 distributions are neither flat nor one-hot."""
    from deepspec.targets import tiny_target

    model, tok = tiny_target("llama", seed=4)
    model.lm_head.weight.data *= 4.5
    prompt = list(tok("<|im_start|>user\nTell me a story<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
    return model, prompt


def test_oracle_draft_in_the_decoding_loop(sharp_tiny):
    """generate_speculative with q = p_target at T = 1: acc0 = 1 under probabilistic drafts; under greedy drafts the
    accepted first drafts match the sum of the rounds' max p (within 4 sigma), well below 1."""
    from deepspec.eval.decode import generate_speculative

    model, prompt = sharp_tiny
    T = 1.0
    prob = generate_speculative(model, TargetOracle(model, T), [0], prompt, max_new_tokens=60, num_draft_tokens=3,
                                temperature=T, generator=torch.Generator().manual_seed(1), draft_sample_method="probabilistic")
    s = prob.stats
    assert s.reached[0] >= 10 and s.accepted_at[0] == s.reached[0]  # every first draft accepted (acc0 = 1)
    assert s.accepted == s.proposed

    oracle = TargetOracle(model, T)
    counts = [0, 0]
    maxp: list[float] = []
    for seed in range(6):  # several answers, so the statistic has enough rounds
        run = generate_speculative(model, oracle, [0], prompt, max_new_tokens=40, num_draft_tokens=2, temperature=T,
                                   generator=torch.Generator().manual_seed(100 + seed), draft_sample_method="greedy")
        counts[0] += run.stats.accepted_at[0]
        counts[1] += run.stats.reached[0]
        maxp += oracle.first_max_p
    m = torch.tensor(maxp, dtype=torch.float64)
    assert len(maxp) == counts[1]
    expected, sigma = float(m.sum()), float((m * (1 - m)).sum().sqrt())
    assert 0.2 < float(m.mean()) < 0.85, float(m.mean())  # the target is neither flat nor greedy at T=1 here
    assert abs(counts[0] - expected) < 4 * sigma + 1, (counts, expected, sigma)
    assert counts[1] - expected > 6 * sigma  # far from acc0 = 1


@pytest.mark.slow
def test_greedy_protocol_loop_is_lossless_in_distribution(sharp_tiny):
    """The decoding loop under the greedy protocol, with a draft that proposes the target's argmax (accepted ~40% of the
    time here): the first two tokens follow the target's own T = 1 joint distribution (chi-square over bins fixed in
    advance: (likely first token, the argmax after it), (that first token, anything else), any other first token).
    A recovery that kept the rejected draft's mass would put 2.5x too much in the first bin."""
    from deepspec.eval.decode import generate_speculative

    model, prompt = sharp_tiny

    class TargetArgmax(Proposer):
        def reset(self):
            pass

        def propose(self, input_ids, new_taps, start, num_tokens, temperature=0.0, generator=None):
            assert temperature == 0.0  # the greedy protocol drafts at T = 0
            z = model(input_ids=input_ids[None]).logits[0, -1]
            return z.argmax()[None], None

    def dist(ids):
        with torch.no_grad():
            return torch.softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)

    # bins fixed before sampling
    p1 = dist(prompt)
    bins: dict[tuple, float] = {}
    for a in (p1 > 0.05).nonzero().flatten().tolist():
        p2 = dist(prompt + [a])
        top = p2.topk(1).indices.tolist()
        for b in top:
            bins[(a, b)] = float(p1[a] * p2[b])
        bins[(a, "other")] = float(p1[a] * (1 - p2[top].sum()))
    bins[("other",)] = 1.0 - sum(bins.values())
    assert len(bins) >= 3 and min(bins.values()) > 0.01
    N = 400
    counts = dict.fromkeys(bins, 0)
    accepted = 0
    for i in range(N):
        run = generate_speculative(model, TargetArgmax(), [0], prompt, max_new_tokens=2, num_draft_tokens=1, temperature=1.0,
                                   generator=torch.Generator().manual_seed(i), draft_sample_method="greedy")
        a, b = run.tokens[:2]
        accepted += run.stats.accepted
        key = (a, b) if (a, b) in counts else (a, "other") if (a, "other") in counts else ("other",)
        counts[key] += 1
    exp = {k: v * N for k, v in bins.items()}
    chi2 = sum((counts[k] - exp[k]) ** 2 / exp[k] for k in bins)
    dof = len(bins) - 1
    # P(chi2 > dof + 5 sqrt(2 dof)) is below 0.001 for these dof
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof, counts, exp)
    assert 0.1 * N < accepted < 0.9 * N  # the draft was accepted sometimes, rejected sometimes


# ----------------------------------------------------------------------------------------- the eval stage's reports


def test_eval_names_protocol_pools_and_averages_and_records_serving_mode(tmp_path, tiny_llama_dir, logs):
    """A T=1 greedy-protocol eval: every tau in results.json / results.md names its protocol, overall comes pooled and
    as the per-benchmark mean (each labelled), and a chat mode other than the training data's is recorded + warned."""
    import json

    from transformers import AutoConfig

    from deepspec.config import load_config
    from deepspec.config.model import ModelConfig
    from deepspec.drafts.checkpoint import save_draft
    from deepspec.drafts.registry import get_algorithm
    from deepspec.eval.runner import evaluate

    torch.manual_seed(0)
    draft = get_algorithm("eagle3").from_target_config(AutoConfig.from_pretrained(tiny_llama_dir), ModelConfig(algorithm="eagle3"))
    ckpt = save_draft(draft, tmp_path / "step_1", provenance={"target": "tiny-llama", "target_path": str(tiny_llama_dir),
                                                              "chat_template_kwargs": {"enable_thinking": False}})
    d = tmp_path / "ds"
    d.mkdir()
    (d / "gsm8k.jsonl").write_text("".join(json.dumps({"turns": [f"What is {i} + {i}?"]}) + "\n" for i in range(2)))
    (d / "alpaca.jsonl").write_text(json.dumps({"turns": ["Name a color."]}) + "\n")
    out = tmp_path / "eval"
    cfg = load_config(None, [
        f"eval.datasets_dir={d}", "eval.tasks=[gsm8k,alpaca]", "eval.max_new_tokens=8", "eval.num_draft_tokens=2",
        f"eval.output_dir={out}", "logging.wandb=false", "eval.measure_speedup=false", "eval.temperature=1.0",
        "eval.draft_sample_method=greedy", "target.chat_template_kwargs={enable_thinking: true}",
    ])
    res = evaluate(cfg, ckpt)
    on_disk = json.loads((out / "results.json").read_text())
    proto = "greedy drafts, T=1"
    assert on_disk["meta"]["protocol"] == proto and on_disk["meta"]["draft_sample_method"] == "greedy"
    assert all(on_disk["tasks"][t]["protocol"] == proto for t in ("gsm8k", "alpaca"))
    assert on_disk["overall"]["protocol"] == proto and on_disk["overall"]["aggregation"].startswith("pooled")
    mean = on_disk["overall_benchmark_mean"]
    assert mean["protocol"] == proto and mean["aggregation"].startswith("mean of the per-benchmark")
    assert mean["tau"] == pytest.approx((res["tasks"]["gsm8k"]["tau"] + res["tasks"]["alpaca"]["tau"]) / 2)
    md = (out / "results.md").read_text()
    assert f"**{proto}**" in md and "**overall (pooled)**" in md and "**overall (benchmark mean)**" in md
    serving = on_disk["meta"]["serving_mode"]
    assert serving["chat_template_kwargs"] == {"enable_thinking": True}
    assert serving["training_chat_template_kwargs"] == {"enable_thinking": False} and serving["matches_training"] is False
    warned = [r for r in logs.records if r.levelname == "WARNING" and "chat_template_kwargs" in r.getMessage()]
    assert len({r.getMessage() for r in warned}) == 1 and "enable_thinking" in warned[0].getMessage()  # one line (caplog may hold it twice)
    assert "differs from the training data's" in md


def test_compare_reports_like_for_like_only():
    from deepspec.eval.engine import compare
    from deepspec.eval.metrics import AcceptanceStats

    ours = AcceptanceStats()
    for a in (2, 1, 0):
        ours.add_round(3, a)
    engine = {"mean_acceptance_length": 2.0, "acceptance_rate_per_pos": [0.6, 0.3, 0.1]}
    same = compare(ours.summary(), engine, 3, "greedy drafts, T=1", "greedy drafts, T=1")
    assert same["same_protocol"] and same["relative_diff"] == pytest.approx((2.0 - 2.0) / 2.0)
    other = compare(ours.summary(), engine, 3, "probabilistic drafts, T=1", "greedy drafts, T=1")
    assert not other["same_protocol"] and other["relative_diff"] is None
    assert other["engine_tau"] == 2.0 and other["ours_tau_at_S"] == pytest.approx(2.0)


def test_engine_requests_are_unseeded_on_cpu_and_plain_sampling(monkeypatch):
    """vLLM's CPU build dies on a per-request seed: on a machine without a GPU the client sends none; every request
    asks for plain temperature sampling (no generation_config top_k / top_p / penalties)."""
    from types import SimpleNamespace

    from deepspec.eval import engine as eng

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert eng.engine_seeded() is False
    sent = []

    class FakeHTTP:
        def post(self, path, json):
            sent.append(json)
            return SimpleNamespace(status_code=200, json=lambda: {"choices": [{"message": {"content": "ok"}}], "usage": {}})

    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kw):
            return "x"

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [1, 2]}

    cfg = SimpleNamespace(target=SimpleNamespace(chat_template_kwargs={"enable_thinking": False}),
                          eval=SimpleNamespace(max_new_tokens=8, temperature=1.0))
    for seeded in (False, True):
        client = eng._Client("http://127.0.0.1:1/v1", "m", Tok(), cfg, 64, seeded=seeded)
        client.http = FakeHTTP()
        assert client.chat([{"role": "user", "content": "hi"}], seed=5) == "ok"
    assert "seed" not in sent[0] and sent[1]["seed"] == 5
    for body in sent:
        assert body["temperature"] == 1.0 and body["top_p"] == 1.0 and body["top_k"] == 0 and body["repetition_penalty"] == 1.0
        assert body["chat_template_kwargs"] == {"enable_thinking": False}
