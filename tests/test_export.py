"""Export layouts (config keys, weight names, layer-id translation), target checks and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from deepspec.config.model import ModelConfig
from deepspec.drafts import get_algorithm
from deepspec.drafts.checkpoint import save_draft
from deepspec.errors import CheckpointError, ConfigError
from deepspec.export.writers import export_draft
from deepspec.targets import tiny_config


def _ckpt(tmp_path, family, algorithm, name="ckpt", prov=None, **fields):
    fields.setdefault("target_layer_ids", [0, 2, 3])
    cfg = ModelConfig(algorithm=algorithm, block_size=4, markov_rank=8, **fields)
    draft = get_algorithm(algorithm).from_target_config(tiny_config(family), cfg)
    if algorithm == "eagle3":
        draft.set_token_frequencies(torch.arange(320).float())
    prov = prov if prov is not None else {"target": f"tiny-{family}", "target_vocab_size": 320, "target_hidden_size": 64, "target_num_layers": 6}
    return draft, save_draft(draft, tmp_path / name, prov)


def _read(out):
    return json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


LAYER = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
         "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


def test_eagle3_llama_layout(tmp_path, tiny_llama_dir):
    draft, ckpt = _ckpt(tmp_path, "llama", "eagle3", draft_vocab_size=100, num_draft_layers=2)
    out = export_draft(ckpt, tmp_path / "out", "vllm", target=str(tiny_llama_dir))
    cfg, w = _read(out)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # our taps + 1
    assert cfg["num_aux_hidden_states"] == 3
    assert (cfg["draft_vocab_size"], cfg["vocab_size"], cfg["target_hidden_size"], cfg["num_hidden_layers"]) == (100, 320, 64, 2)
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and cfg["norm_before_fc"] is False
    expected = {"fc.weight", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                "midlayer.hidden_norm.weight"} | {f"midlayer.{n}" for n in LAYER} | {f"layers.1.{n}" for n in LAYER}
    assert set(w) == expected
    assert w["midlayer.self_attn.q_proj.weight"].shape == (64, 128) and w["fc.weight"].shape == (64, 192)
    assert w["lm_head.weight"].shape == (100, 64) and w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert torch.equal(w["d2t"], draft.d2t) and w["fc.weight"].dtype == torch.bfloat16
    assert cfg["deepspec"]["provenance"]["target"] == "tiny-llama"


def test_eagle3_with_the_embeddings_tap_tells_vllm_how_many_taps_fc_reads(tmp_path, tiny_llama_dir):
    """vLLM sizes the drafter's fc from num_aux_hidden_states and assumes 3 without it: a 4-tap draft
    (embeddings + 3 layers, as model.init_copy_heads uses) failed to load with a [64, 256] vs [64, 192] fc."""
    _, ckpt = _ckpt(tmp_path, "llama", "eagle3", draft_vocab_size=100, target_layer_ids=[-1, 0, 2, 3])
    cfg, w = _read(export_draft(ckpt, tmp_path / "out", "vllm", target=str(tiny_llama_dir)))
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3, 4] and cfg["num_aux_hidden_states"] == 4
    assert w["fc.weight"].shape == (64, 4 * 64)


def test_eagle3_qwen3_full_vocab_layout(tmp_path, tiny_qwen3_dir):
    _, ckpt = _ckpt(tmp_path, "qwen3", "eagle3", fc_norm=False, norm_output=False)
    cfg, w = _read(export_draft(ckpt, tmp_path / "out", "vllm", target=str(tiny_qwen3_dir)))
    assert cfg["architectures"] == ["Eagle3Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert "midlayer.self_attn.q_norm.weight" in w and "d2t" not in w and not any(k.startswith("fc_norm") for k in w)
    assert cfg["draft_vocab_size"] == 320 and cfg["fc_norm"] is False


def test_dflash_layout(tmp_path, tiny_llama_dir):
    _, ckpt = _ckpt(tmp_path, "llama", "dflash", num_draft_layers=2, mask_token_id=259)
    cfg, w = _read(export_draft(ckpt, tmp_path / "out", "vllm", target=str(tiny_llama_dir)))
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": 259, "target_layer_ids": [0, 2, 3], "causal": False}
    assert cfg["block_size"] == 4 and cfg["num_hidden_layers"] == 2
    assert cfg["deepspec"]["num_speculative_tokens"] == 3  # vLLM must draft the whole block: block_size - 1
    with pytest.raises(ConfigError, match="block_size=4"):
        export_draft(_ckpt(tmp_path, "llama", "dflash", name="s5")[1], tmp_path / "out5", "vllm", num_speculative_tokens=5)
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{n}" for i in range(2) for n in LAYER + ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]}
    assert set(w) == expected
    _, bad = _ckpt(tmp_path, "llama", "dflash", name="bad", sample_from_anchor=True)
    with pytest.raises(ConfigError, match="sample_from_anchor"):
        export_draft(bad, tmp_path / "out2", "vllm")


def test_dspark_export_parsed_by_vllm_speculators_config(tmp_path):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    _, ckpt = _ckpt(tmp_path, "qwen3", "dspark", mask_token_id=259)
    out = export_draft(ckpt, tmp_path / "out", "vllm")
    cfg, w = _read(out)
    parsed = SpeculatorsConfig.from_pretrained(str(out))
    assert parsed.architectures == ["Qwen3DSparkModel"]
    assert parsed.target_layer_ids == [0, 2, 3] and parsed.eagle_aux_hidden_state_layer_ids == [1, 3, 4]
    assert (parsed.mask_token_id, parsed.markov_rank, parsed.markov_head_type, parsed.block_size) == (259, 8, "vanilla", 4)
    assert parsed.enable_confidence_head is True and parsed.confidence_head_with_markov is True
    assert parsed.sample_from_anchor is True and parsed.dspark_bonus_anchor is False
    assert (parsed.hidden_size, parsed.num_hidden_layers, parsed.vocab_size, parsed.draft_vocab_size) == (64, 1, 320, 320)
    spec = SpeculatorsConfig.extract_vllm_speculative_config(cfg)
    assert spec == {"method": "dspark", "num_speculative_tokens": 4}
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"} <= set(w)
    assert w["markov_head.markov_w1.weight"].shape == (320, 8) and w["confidence_head.proj.weight"].shape == (1, 72)
    assert w["confidence_head.proj.weight"].dtype == torch.float32  # vLLM keeps this head in fp32
    _, gated = _ckpt(tmp_path, "qwen3", "dspark", name="gated", markov_head_type="gated")
    with pytest.raises(ConfigError, match="vanilla"):
        export_draft(gated, tmp_path / "out3", "vllm")
    assert json.loads((export_draft(gated, tmp_path / "out4", "sglang") / "config.json").read_text())["markov_head_type"] == "gated"


def test_export_refuses_other_target(tmp_path, tiny_llama_dir, tiny_qwen3_dir):
    _, ckpt = _ckpt(tmp_path, "llama", "eagle3", prov={"target_vocab_size": 999, "target_hidden_size": 64})
    with pytest.raises(CheckpointError, match="target_vocab_size=999"):
        export_draft(ckpt, tmp_path / "out", "vllm", target=str(tiny_llama_dir))
    prov = {"target_architecture": "LlamaForCausalLM", "target_path": str(tiny_qwen3_dir)}
    _, ckpt2 = _ckpt(tmp_path, "llama", "eagle3", name="c2", prov=prov)
    with pytest.raises(CheckpointError, match="Qwen3ForCausalLM"):
        export_draft(ckpt2, tmp_path / "out", "vllm")  # recorded target path is checked without --target
    _, ckpt3 = _ckpt(tmp_path, "llama", "eagle3", name="c3", prov={"template_hash": "0000000000000000"})
    with pytest.raises(CheckpointError, match="template"):
        export_draft(ckpt3, tmp_path / "out", "vllm", target=str(tiny_llama_dir))
    with pytest.raises(CheckpointError, match="trained for another target"):
        export_draft(_ckpt(tmp_path, "llama", "eagle3", name="c4", prov={})[1], tmp_path / "o", "vllm",
                     target=str(_small_target(tmp_path)))
    assert not (tmp_path / "out").exists()


def _small_target(tmp_path):
    from deepspec.targets import save_tiny_target

    return save_tiny_target(tmp_path / "other", "llama", hidden_size=32, head_dim=8)


def test_export_cli(tmp_path, tiny_llama_dir, capsys):
    from deepspec.cli import main
    from deepspec.config import load_config

    draft, _ = _ckpt(tmp_path, "llama", "dflash")
    ckpt = save_draft(draft, tmp_path / "ckpt", {}, config=load_config(None, ["model.algorithm=dflash"]))
    assert main(["export", str(ckpt), "--format", "vllm", "--target", str(tiny_llama_dir)]) == 0
    out = tmp_path / "ckpt-vllm"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert "algorithm: dflash" in (out / "deepspec_config.yaml").read_text()
    assert main(["export", str(tmp_path / "missing"), "--format", "vllm"]) != 0


def test_export_refuses_a_draft_mlp_the_engines_do_not_run(tmp_path):
    """vLLM's and SGLang's draft layers are SiLU-gated: another activation would load but not run as trained."""
    _, ckpt = _ckpt(tmp_path, "llama", "eagle3")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["deepspec"]["arch"]["hidden_act"] = "gelu_pytorch_tanh"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    for fmt in ("vllm", "sglang"):
        with pytest.raises(ConfigError, match="gelu_pytorch_tanh"):
            export_draft(ckpt, tmp_path / fmt, fmt)


def test_sglang_dspark_block_size_is_sglangs_gamma(tmp_path):
    """SGLang's DSpark drafts gamma = config block_size tokens, querying gamma slots when the anchor predicts and
    gamma + 1 when it does not; ours queries block_size slots either way."""
    for anchor, gamma in ((None, 4), (True, 4), (False, 3)):  # None: DSpark's default, the anchor predicts
        _, ckpt = _ckpt(tmp_path, "qwen3", "dspark", name=f"a{anchor}", mask_token_id=259, sample_from_anchor=anchor)
        cfg, _ = _read(export_draft(ckpt, tmp_path / f"o{anchor}", "sglang"))
        assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == gamma and cfg["sample_from_anchor"] is (anchor is not False)
        assert cfg["deepspec"]["num_speculative_tokens"] == gamma
