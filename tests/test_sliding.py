"""Sliding-window draft layers: the window bites (window < T changes outputs, window >= T equals full
attention), and the training attention is what the proposers compute at decoding time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepspec.config.model import ModelConfig
from deepspec.drafts import DraftBatch, get_algorithm
from deepspec.drafts.checkpoint import target_weights
from deepspec.errors import ConfigError
from deepspec.targets import capture, tiny_target

T = 20


def _setup(algorithm: str, window: int | None, layers: int = 2):
    torch.manual_seed(0)
    model, _ = tiny_target("llama" if algorithm == "eagle3" else "qwen3")
    types = None if window is None else ["sliding_attention"] + ["full_attention"] * (layers - 1)
    cfg = ModelConfig(
        algorithm=algorithm, target_layer_ids=[0, 2, 4], num_draft_layers=layers, ttt_length=4, block_size=4, num_anchors=4,
        markov_rank=8, layer_types=types, sliding_window=window,
    )
    draft = get_algorithm(algorithm).from_target_config(model.config, cfg)
    draft.load_target_weights(*target_weights(model))
    draft.eval()
    ids = torch.randint(0, 250, (1, T), generator=torch.Generator().manual_seed(2))
    taps, final = capture(model, ids, draft.taps)
    return model, draft, ids, taps, final


def _eagle3_logits(window):
    _, d, ids, taps, _ = _setup("eagle3", window)
    with torch.no_grad():
        return [lg for _, lg in d.ttt_steps(ids, taps)]


def _block_hidden(algorithm, window):
    _, d, ids, taps, final = _setup(algorithm, window)
    ones = torch.ones_like(ids, dtype=torch.bool)
    anchors = torch.tensor([[2, 9, 13, 16]])
    with torch.no_grad():
        return d.block_hidden(DraftBatch(ids, ones, ones, taps, final), anchors, torch.ones_like(anchors, dtype=torch.bool))


def test_eagle3_window_bites_and_a_wide_window_is_full_attention():
    full = _eagle3_logits(None)
    wide = _eagle3_logits(T + 4)  # covers every query's keys (query positions reach T-1+3)
    narrow = _eagle3_logits(4)
    for f, w in zip(full, wide):
        torch.testing.assert_close(w, f, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(narrow[0][:, -5:], full[0][:, -5:], atol=1e-4)
    torch.testing.assert_close(narrow[0][:, :4], full[0][:, :4], rtol=1e-5, atol=1e-5)  # rows < window see everything


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_block_window_bites_and_a_wide_window_is_full_attention(algorithm):
    full = _block_hidden(algorithm, None)
    torch.testing.assert_close(_block_hidden(algorithm, T + 4), full, rtol=1e-5, atol=1e-5)
    narrow = _block_hidden(algorithm, 4)  # the shortest window a block of 4 allows (config/model.py)
    assert not torch.allclose(narrow[0, 3], full[0, 3], atol=1e-4)  # anchor 16: context 0..15 cut to 13..15


@pytest.mark.parametrize("r", [3, 12])
def test_eagle3_proposer_equals_training_with_a_sliding_layer(r):
    _, d, ids, taps, _ = _setup("eagle3", 3)
    k_n = d.model_cfg.ttt_length
    prop = d.proposer()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        toks, probs = prop.propose(ids[0, : r + 2], taps[0, : r + 1], 0, k_n, temperature=1.0, generator=gen)
        # the training chain on the same tokens: row r at step k reads the proposer's k-th token
        chain = torch.cat([ids[0, : r + 2], toks[:-1]]).unsqueeze(0)
        t2 = chain.shape[1]
        tp = torch.cat([taps[0, : r + 1], taps[0, :1].expand(t2 - r - 1, -1, -1)]).unsqueeze(0)
        steps = [lg for _, lg in d.ttt_steps(chain, tp)]
    for k in range(k_n):
        torch.testing.assert_close(torch.softmax(steps[k][0, r].float(), -1), probs[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
@pytest.mark.parametrize("anchor", [2, 15])
def test_block_proposer_equals_training_with_a_sliding_layer(algorithm, anchor):
    _, d, ids, taps, final = _setup(algorithm, 4)
    prop = d.proposer()
    with torch.no_grad():
        prop.propose(ids[0, : anchor + 1], taps[0, :anchor], 0, d.num_predictions)
        ones = torch.ones_like(ids, dtype=torch.bool)
        a = torch.tensor([[anchor]])
        h = d.block_hidden(DraftBatch(ids, ones, ones, taps, final), a, torch.ones_like(a, dtype=torch.bool))[0, 0, d.first_slot :]
    torch.testing.assert_close(prop.last_hidden, h, rtol=1e-5, atol=1e-5)


def test_sliding_settings_are_validated_and_exported():
    with pytest.raises(ConfigError, match="sliding_window"):
        ModelConfig(layer_types=["sliding_attention"]).validate()
    with pytest.raises(ConfigError, match="one entry per draft layer"):
        ModelConfig(layer_types=["full_attention"] * 2, num_draft_layers=1).validate()
    _, d, *_ = _setup("dflash", 5)
    arch = d.export_config()["arch"]
    assert arch["layer_types"] == ["sliding_attention", "full_attention"] and arch["sliding_window"] == 5
    from deepspec.export.writers import _sizes

    cfg = _sizes(arch, "qwen3")
    assert cfg["layer_types"] == arch["layer_types"] and cfg["sliding_window"] == 5 and cfg["use_sliding_window"]


def _export(smollm2_dir, tmp_path, algorithm: str, **fields):
    """An untrained draft for SmolLM2, saved and exported for vLLM."""
    from transformers import AutoConfig

    from deepspec.drafts.checkpoint import save_draft
    from deepspec.export.writers import export_draft

    tc = AutoConfig.from_pretrained(smollm2_dir)
    cfg = ModelConfig(algorithm=algorithm, **fields)
    torch.manual_seed(0)
    draft = get_algorithm(algorithm).from_target_config(tc, cfg)
    if algorithm != "eagle3" and fields.get("draft_vocab_size"):  # a block draft's head = the target's rows
        from deepspec.train.build import load_target_head

        draft.load_target_weights(*load_target_head(str(smollm2_dir), tc))
    if algorithm == "eagle3" or fields.get("draft_vocab_size"):
        draft.set_token_frequencies(torch.arange(tc.vocab_size, 0, -1).float())
    prov = {"target": "smollm2-135m-instruct", "target_path": str(smollm2_dir), "target_vocab_size": tc.vocab_size,
            "target_hidden_size": tc.hidden_size, "target_num_layers": tc.num_hidden_layers, "target_architecture": "LlamaForCausalLM"}
    ckpt = save_draft(draft, tmp_path / f"{algorithm}-ckpt", prov)
    return export_draft(ckpt, tmp_path / f"{algorithm}-vllm", "vllm", target=str(smollm2_dir))


def _serve_and_count(smollm2_dir, draft_dir, method: str, k: int, tmp_path) -> dict:
    """vLLM's spec-decode counters over two short greedy completions with the draft served."""
    import urllib.request

    from deepspec.serving import VLLMServer

    spec = {"method": method, "model": str(draft_dir), "num_speculative_tokens": k}
    with VLLMServer(smollm2_dir, speculative_config=spec, log_path=tmp_path / f"{method}.log", max_model_len=1024) as server:
        before = server.spec_decode_counters()
        for prompt in ("The capital of France is", "def fibonacci(n):"):
            body = json.dumps({"model": server.served_model_name, "prompt": prompt, "max_tokens": 24, "temperature": 0}).encode()
            req = urllib.request.Request(server.url + "/completions", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                assert json.loads(r.read())["choices"][0]["text"]
        after = server.spec_decode_counters()
    return {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted_tokens")}


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_serves_a_sliding_window_dflash_export(smollm2_dir, tmp_path):
    """The exported layer_types / sliding_window load in real vLLM (CPU) and the draft is served."""
    pytest.importorskip("vllm")
    import json

    draft_dir = _export(smollm2_dir, tmp_path, "dflash", block_size=4, num_draft_layers=1, layer_types=["sliding_attention"], sliding_window=64)
    cfg = json.loads((draft_dir / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention"] and cfg["sliding_window"] == 64
    counts = _serve_and_count(smollm2_dir, draft_dir, "dflash", 3, tmp_path)
    assert counts["drafts"] > 0 and counts["draft_tokens"] == 3 * counts["drafts"]


# Short questions whose greedy answers (cut at ANSWER tokens) a one-layer draft can memorise in a few hundred steps.
# The first is held out by the prompts stage (heldout=1), the rest are trained on and evaluated.
PROMPTS = [
    "What is the boiling point of water?", "Name three primary colors.", "What is the capital of France?",
    "Count from one to ten.", "List the days of the week.", "What is two plus two?", "Say hello in Spanish.",
    "Name the planets of the solar system.", "What color is the sky?",
]
ANSWER = 24  # tokens per answer: SmolLM2's chat prompt (its default system message included) + answer is ~60 > WINDOW
WINDOW = 32
STEPS = 300


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_trained_sliding_window_dflash_served_by_vllm_matches_our_eval(smollm2_dir, tmp_path, monkeypatch):
    """A DFlash draft with a sliding window shorter than its sequences, trained to memorise a few answers, is
    served by real vLLM (CPU) on the prompts it learnt: vLLM's mean acceptance length equals our tau@S (S =
    block_size - 1, the served depth) within 10%, and both are clearly above 1, so the served draft computes what
    we trained (a window vLLM ignored or applied differently would split the two)."""
    pytest.importorskip("vllm")
    from deepspec.config import load_config
    from deepspec.pipeline import run

    monkeypatch.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in PROMPTS))
    recipe = str(Path(__file__).resolve().parents[1] / "config" / "quickstart" / "dflash.yaml")
    opts = [
        f"output_root={tmp_path / 'out'}", f"train.output_root={tmp_path / 'ckpt'}", "target.dtype=float32",
        f"data.prompts.source={prompts}", "data.prompts.max_samples=null", "data.prompts.heldout=1",
        "data.regenerate.engine=hf", f"data.regenerate.sampling.max_tokens={ANSWER}", "cache.max_length=256",
        "model.num_draft_layers=1", "model.block_size=4", "model.layer_types=[sliding_attention]", f"model.sliding_window={WINDOW}",
        f"train.max_steps={STEPS}", f"train.val_every={STEPS}", f"train.save_every={STEPS}", "train.precision=fp32",
        "train.warmup_ratio=0.0", "logging.wandb=false",
        "eval.max_samples=null", f"eval.max_new_tokens={ANSWER}", "eval.num_draft_tokens=3", "eval.num_workers=1",
        "eval.measure_speedup=false", "eval.engine_speedup=false", "eval.engine_max_model_len=1024",
    ]
    trained = load_config(recipe, opts).conversations_path  # the train split the prompts stage writes
    (res,) = run([recipe], [*opts, f"eval.tasks=[{trained}]"])

    from deepspec.data.cache.reader import CacheDataset

    cache = CacheDataset(res.cfg.cache_train_dir)
    lengths = [len(cache[i]["input_ids"]) for i in range(len(cache))]
    assert len(lengths) == len(PROMPTS) - 1 and min(lengths) > WINDOW + 8, lengths  # the window bites on every sequence
    exported = json.loads((res.eval_dir / "export-vllm" / "config.json").read_text())
    assert exported["layer_types"] == ["sliding_attention"] and exported["sliding_window"] == WINDOW
    engine = res.results["engine"]
    assert engine["num_speculative_tokens"] == 3
    ours, served = engine["overall"]["ours_tau_at_S"], engine["overall"]["engine_tau"]
    print(f"sliding-window DFlash, S=3: ours tau@3 {ours:.3f}, vLLM mean acceptance length {served:.3f}")
    assert engine["overall"]["engine_drafts"] > 0
    assert ours >= 1.3, res.results["overall"]
    assert abs(served - ours) / ours <= 0.10, engine["overall"]
