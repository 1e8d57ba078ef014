"""Greedy replay (eval.greedy_replay) against today's speculative loop: at T=0 the replayed rounds, tokens and
counters equal `generate_speculative`'s, for every draft algorithm and for an oracle proposer whose misses give
non-trivial acceptance; batched greedy answers equal batch-1 greedy decoding; the eval stage reports the same
counters either way (multi-turn prompts included; the tiny random target's drafts are rejected, so acceptance itself
is pinned by the oracle tests above)."""

from __future__ import annotations

import json

import pytest
import torch

from deepspec.drafts.registry import available_algorithms
from deepspec.eval.decode import generate_speculative, generate_target_only, greedy_answers, replay_speculative
from deepspec.targets import tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COUNTERS = ("rounds", "proposed", "accepted", "generated", "reached", "accepted_at")


def _same(a, b) -> None:
    assert a.tokens == b.tokens
    for key in COUNTERS:
        assert getattr(a.stats, key) == getattr(b.stats, key), key
    assert a.stopped_by_eos == b.stopped_by_eos


def _prompt(tok, text: str) -> list[int]:
    return list(tok(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")["input_ids"])


def _continuation(model, prompt, n, eos=frozenset()):
    return greedy_answers(model, [prompt], max_new_tokens=n, eos_ids=eos)[0]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("algo", available_algorithms())
def test_replay_equals_decoding_for_every_draft(algo, family):
    from test_eval_lossless import _random_draft

    model, tok = tiny_target(family, seed=1)
    draft = _random_draft(algo, model, block_size=4, ttt_length=4)
    prompt = _prompt(tok, "Count with me: one two three")
    n, k = 40, 4
    spec = generate_speculative(model, draft.proposer(), draft.taps, prompt, max_new_tokens=n, num_draft_tokens=k)
    rep = replay_speculative(model, draft.proposer(), draft.taps, prompt, _continuation(model, prompt, n + k + 1),
                             max_new_tokens=n, num_draft_tokens=k)
    _same(rep, spec)


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    """The embedded SmolLM2 in fp32: varied greedy answers (tiny random targets repeat one token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    def render(q: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    prompts = [render(q) for q in ("Name three fruits.", "Explain what a list is in Python, briefly.", "Hi")]
    return model, prompts


@pytest.mark.slow
@pytest.mark.parametrize("break_every", [0, 3])
def test_replay_equals_decoding_with_partial_acceptance(smol, break_every):
    """The oracle proposes the target's own greedy tokens and misses at depth 2 every `break_every` rounds: rounds of
    several lengths, bonus tokens, the length cap cutting the last round."""
    from test_eval_decode import OracleProposer

    model, prompts = smol
    n, k = 16, 4
    prompt = prompts[0]
    spec = generate_speculative(model, OracleProposer(model, break_every), [0, 15, 28], prompt, max_new_tokens=n, num_draft_tokens=k)
    rep = replay_speculative(model, OracleProposer(model, break_every), [0, 15, 28], prompt, _continuation(model, prompt, n + k + 1),
                             max_new_tokens=n, num_draft_tokens=k)
    _same(rep, spec)
    assert spec.stats.accepted > 0 and (break_every == 0 or spec.stats.accepted < spec.stats.proposed)


@pytest.mark.slow
def test_replay_stops_at_eos_like_decoding(smol):
    from test_eval_decode import OracleProposer

    model, prompts = smol
    prompt = prompts[1]
    greedy = _continuation(model, prompt, 20)
    j = next(i for i, t in enumerate(greedy) if i >= 4 and t not in greedy[:i])
    eos = {greedy[j]}  # pretend a greedy token (first seen at j >= 4) is EOS
    for brk in (0, 2):
        spec = generate_speculative(model, OracleProposer(model, brk), [0, 15, 28], prompt, max_new_tokens=30, num_draft_tokens=4, eos_ids=eos)
        cont = _continuation(model, prompt, 35, eos)
        assert cont[-1] in eos and len(cont) == j + 1
        rep = replay_speculative(model, OracleProposer(model, brk), [0, 15, 28], prompt, cont, max_new_tokens=30, num_draft_tokens=4, eos_ids=eos)
        _same(rep, spec)
        assert rep.stopped_by_eos


def test_replay_refuses_a_short_answer(smol):
    from test_eval_decode import OracleProposer

    model, prompts = smol
    with pytest.raises(ValueError, match="max_new_tokens \\+ num_draft_tokens \\+ 1"):
        replay_speculative(model, OracleProposer(model), [0, 15, 28], prompts[0], _continuation(model, prompts[0], 10),
                           max_new_tokens=10, num_draft_tokens=4)


@pytest.mark.slow
def test_batched_greedy_answers_equal_batch_one_decoding(smol):
    """Left padding and length sorting change nothing: each answer is the prompt's own greedy answer (fp32)."""
    model, prompts = smol
    eos = {_continuation(model, prompts[2], 9)[8]}  # stops one of them early
    batched = greedy_answers(model, prompts, max_new_tokens=16, eos_ids=eos, pad_id=0, batch_size=2)
    for p, got in zip(prompts, batched):
        assert got == generate_target_only(model, p, max_new_tokens=16, eos_ids=eos).tokens
    assert any(len(a) < 16 for a in batched) and len({tuple(a) for a in batched}) == 3


def test_eval_stage_replay_reports_the_decoding_counters(tmp_path, tiny_llama_dir):
    """evaluate() with eval.greedy_replay: same per-task counters and answers as decoding, MT-Bench's second turn
    asked after the first answer; a sampled or timed replay is refused."""
    from deepspec.errors import ConfigError
    from deepspec.eval.runner import evaluate
    from test_eval_runner import _cfg

    from transformers import AutoModelForCausalLM

    from deepspec.config.model import ModelConfig
    from deepspec.drafts.checkpoint import save_draft
    from deepspec.drafts.registry import get_algorithm

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    torch.manual_seed(0)
    draft = get_algorithm("eagle3").from_target_config(target.config, ModelConfig(algorithm="eagle3"))
    ckpt = tmp_path / "step_3"
    save_draft(draft, ckpt, provenance={"target": "tiny-llama", "target_path": str(tiny_llama_dir)})
    data = tmp_path / "eval_datasets"
    data.mkdir()
    (data / "gsm8k.jsonl").write_text("\n".join(json.dumps({"turns": [f"What is {i} + {i}? {'a b ' * i}"]}) for i in range(5)) + "\n")
    (data / "mt-bench.jsonl").write_text(json.dumps({"turns": ["Name a color.", "Now name another one."], "id": "q1"}) + "\n")
    common = ("eval.measure_speedup=false", "eval.max_new_tokens=24", "eval.num_draft_tokens=4")
    dec = evaluate(_cfg(data, tmp_path / "dec", *common), ckpt)
    rep = evaluate(_cfg(data, tmp_path / "rep", *common, "eval.greedy_replay=true", "eval.replay_batch_size=2"), ckpt)
    for task in ("gsm8k", "mt-bench"):
        for key in ("rounds", "proposed_tokens", "accepted_tokens", "generated_tokens", "acc0", "tau@3"):
            assert rep["tasks"][task][key] == dec["tasks"][task][key], (task, key)
    answers = [[t["answer"] for t in json.loads(line)["turns"]] for line in (tmp_path / "rep" / "samples.jsonl").read_text().splitlines()]
    assert answers == [[t["answer"] for t in json.loads(line)["turns"]] for line in (tmp_path / "dec" / "samples.jsonl").read_text().splitlines()]
    assert [len(a) for a in answers] == [1] * 5 + [2]
    with pytest.raises(ConfigError, match="greedy_replay"):
        _cfg(data, tmp_path / "x", "eval.greedy_replay=true", "eval.temperature=0.7", "eval.measure_speedup=false")
    with pytest.raises(ConfigError, match="measure_speedup=false"):
        _cfg(data, tmp_path / "x", "eval.greedy_replay=true")
