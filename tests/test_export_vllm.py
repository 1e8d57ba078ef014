"""Real-engine tests: EAGLE-3.1 and DFlash drafts exported for the embedded SmolLM2 are served by vLLM
(back to back, one server each; DFlash also with a draft vocabulary), and the DSpark export is parsed by vLLM's
own speculators parser (vLLM runs DSpark only on its GPU model runner)."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from deepspec.config.model import ModelConfig
from deepspec.drafts import get_algorithm
from deepspec.drafts.checkpoint import save_draft
from deepspec.export.writers import export_draft


def _export(smollm2_dir, tmp_path, algorithm: str, **fields):
    from transformers import AutoConfig

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
def test_vllm_serves_eagle31_and_dflash_exports(smollm2_dir, tmp_path):
    pytest.importorskip("vllm")
    eagle = _export(smollm2_dir, tmp_path, "eagle3", draft_vocab_size=8192, fc_norm=True, norm_output=True)
    cfg = json.loads((eagle / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["fc_norm"] and cfg["norm_output"]
    counts = _serve_and_count(smollm2_dir, eagle, "eagle3", 3, tmp_path)
    assert counts["drafts"] > 0 and counts["draft_tokens"] == 3 * counts["drafts"]

    dflash = _export(smollm2_dir, tmp_path, "dflash", block_size=4, num_draft_layers=1)
    k = json.loads((dflash / "config.json").read_text())["deepspec"]["num_speculative_tokens"]
    assert k == 3  # served with its training block: vLLM drafts k + 1 = block_size slots
    counts = _serve_and_count(smollm2_dir, dflash, "dflash", k, tmp_path)
    assert counts["drafts"] > 0 and counts["draft_tokens"] == 3 * counts["drafts"]


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_serves_a_draft_vocabulary_dflash_export(smollm2_dir, tmp_path):
    """DFlashQwen3ForCausalLM reads draft_vocab_size, its own lm_head rows and d2t (as draft_id_to_target_id)."""
    pytest.importorskip("vllm")
    from safetensors.torch import load_file

    dflash = _export(smollm2_dir, tmp_path, "dflash", block_size=4, num_draft_layers=1, draft_vocab_size=8192)
    cfg = json.loads((dflash / "config.json").read_text())
    w = load_file(str(dflash / "model.safetensors"))
    assert cfg["draft_vocab_size"] == 8192 and w["lm_head.weight"].shape == (8192, 576) and w["d2t"].shape == (8192,)
    counts = _serve_and_count(smollm2_dir, dflash, "dflash", 3, tmp_path)
    assert counts["drafts"] > 0 and counts["draft_tokens"] == 3 * counts["drafts"]
