"""Targets: a tiny random model per adapter family (dense, MoE, multi-stream), hook-captured taps golden-tested
against HF output_hidden_states, the tap convention, unsupported architectures, the embedded SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepspec.errors import ConfigError, DeepSpecError, TargetError
from deepspec.targets import capture, default_taps, tiny_target, to_vllm_aux_ids, validate_taps
from deepspec.targets.adapters import adapter_for
from deepspec.targets.tiny import tiny_families

ALL_FAMILIES = ["llama", "qwen3", "gemma3", "qwen3_moe", "mixtral", "deepseek_v4", "tiny_mhc"]
MODEL_TYPES = {"gemma3": "gemma3_text", "tiny_mhc": "deepspec_tiny_mhc"}


def test_every_built_in_family_has_a_tiny_target():
    assert sorted(ALL_FAMILIES) == tiny_families()


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_tiny_targets_build_and_run(family):
    model, tok = tiny_target(family)
    assert model.config.model_type == MODEL_TYPES.get(family, family)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi there"}], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert ids.shape[1] > 5
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    # deterministic for a seed
    model2, _ = tiny_target(family)
    assert torch.equal(model2(ids).logits, logits)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tap_k_is_output_of_layer_k(family):
    """Golden: tap k == HF hidden_states[k+1] == output of decoder layer k (via a forward hook)."""
    model, tok = tiny_target(family)
    ids = torch.randint(0, 256, (2, 11))
    layer_out = {}
    hooks = [layer.register_forward_hook(lambda m, i, o, k=k: layer_out.__setitem__(k, o[0] if isinstance(o, tuple) else o))
             for k, layer in enumerate(model.model.layers)]
    taps = [-1, 0, 2, 4]
    feats, final = capture(model, ids, taps)
    for h in hooks:
        h.remove()
    assert feats.shape == (2, 11, len(taps), model.config.hidden_size)
    assert torch.equal(feats[:, :, 0], model.model.embed_tokens(ids))
    for j, k in enumerate(taps[1:], start=1):
        assert torch.equal(feats[:, :, j], layer_out[k])
    # the final hidden is the normed last layer output, and the LM head of it gives HF's logits
    assert torch.allclose(final, model.model.norm(layer_out[len(model.model.layers) - 1]))
    assert torch.allclose(model.lm_head(final), model(ids).logits, atol=1e-5)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_hook_taps_equal_hf_output_hidden_states(family):
    """Golden, every family: hook-captured taps (padded batch) == HF output_hidden_states[k + 1]; the final
    state == HF last_hidden_state; multi-stream families keep [S, H] per tap before reduction."""
    model, _ = tiny_target(family)
    S = adapter_for(model.config).hc_mult(model.config)
    assert (S > 1) == (family in ("deepseek_v4", "tiny_mhc"))
    ids = torch.randint(0, 256, (2, 13))
    att = torch.ones(2, 13, dtype=torch.long)
    att[1, 9:] = 0
    taps = [-1, 0, 2]
    with torch.no_grad():
        ref = model.model(input_ids=ids, attention_mask=att, output_hidden_states=True)
    H = model.config.hidden_size
    for reduction in ("mean", "concat"):
        feats, final = capture(model, ids, taps, attention_mask=att, reduction=reduction)
        width = H * S if reduction == "concat" else H
        assert feats.shape == (2, 13, len(taps), width)
        for j, k in enumerate(taps):
            want = ref.hidden_states[k + 1]
            if S > 1:
                want = want.mean(-2) if reduction == "mean" else want.flatten(-2)
            assert torch.allclose(feats[:, :, j], want, atol=1e-6), (family, reduction, k)
        assert torch.allclose(final, ref.last_hidden_state, atol=1e-6)


def test_unsupported_architecture_names_what_to_implement():
    from transformers import GPT2Config

    with pytest.raises(TargetError) as e:
        adapter_for(GPT2Config(n_layer=2))
    msg = str(e.value)
    assert isinstance(e.value, DeepSpecError)
    assert "gpt2" in msg and "deepspec/targets/adapters/<family>.py" in msg
    for piece in ("embeddings", "decoder layers", "final norm + LM head", "chat template"):
        assert piece in msg


def test_unsupported_architecture_is_refused_at_load(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from deepspec.targets import load_target
    from deepspec.targets.tiny import tiny_tokenizer

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=320)).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(TargetError, match="GPT2LMHeadModel"):
        load_target(str(tmp_path), device="cpu")


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe", "mixtral", "tiny_mhc"])
def test_saved_tiny_target_loads_by_path(family, tmp_path):
    from deepspec.targets import load_target, save_tiny_target

    folder = save_tiny_target(tmp_path / family, family)
    target = load_target(str(folder), device="cpu", dtype="float32")
    ref, _ = tiny_target(family)
    ids = torch.randint(0, 256, (1, 7))
    assert torch.allclose(target.model(ids).logits, ref(ids).logits, atol=1e-5)
    assert target.tokenizer.chat_template


def test_tap_validation_and_translation():
    assert validate_taps([1, 14, 26], 30) == [1, 14, 26]
    with pytest.raises(ConfigError, match="target_layer_ids"):
        validate_taps([1, 29], 30)  # the last layer is excluded
    with pytest.raises(ConfigError, match="target_layer_ids"):
        validate_taps([-2], 30)
    with pytest.raises(ConfigError, match="repeats"):
        validate_taps([3, 3], 30)
    assert to_vllm_aux_ids([1, 14, 26]) == [2, 15, 27]
    # 3 taps = vLLM's default aux ids (2, L//2, L-3) shifted into our convention
    assert to_vllm_aux_ids(default_taps(30)) == [2, 15, 27]
    assert default_taps(36, 5) == [1, 9, 17, 25, 33]  # DeepSpec's Qwen3-4B/8B taps


def test_the_cache_and_the_draft_resolve_taps_by_one_rule():
    """The cache stores the taps the draft built on it reads: both call targets/taps.py resolve_taps, so an unsorted list
    is refused before the cache is built, not after."""
    from types import SimpleNamespace

    from deepspec.config.model import ModelConfig
    from deepspec.data.cache.plan import resolve_taps as cache_taps
    from deepspec.drafts.registry import get_algorithm
    from deepspec.targets.taps import resolve_taps

    assert resolve_taps([], 30) == default_taps(30) and resolve_taps([], 36, 5) == [1, 9, 17, 25, 33]
    for algo in ("eagle3", "dflash"):
        cfg = SimpleNamespace(model=ModelConfig(algorithm=algo))
        count = get_algorithm(algo).default_num_taps
        assert cache_taps(cfg, 36) == resolve_taps([], 36, count)
    with pytest.raises(ConfigError, match="increasing layer order.*give \\[1, 5\\]"):
        cache_taps(SimpleNamespace(model=ModelConfig(algorithm="eagle3", target_layer_ids=[5, 1])), 12)


@pytest.mark.slow
def test_embedded_target_answers_gsm8k_question(smollm2_dir):
    from deepspec.targets import load_target

    target = load_target("smollm2-135m-instruct", device="cpu")
    cfg = target.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert (smollm2_dir / "model.safetensors").is_file() and (smollm2_dir / "tokenizer.json").is_file()
    tok = target.tokenizer
    q = "Tom has 3 apples and buys 5 more. How many apples does Tom have now?"
    enc = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = target.model.generate(**enc, max_new_tokens=60, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "8" in answer and "apple" in answer.lower(), answer


def test_bf16_if_native_follows_the_cpu(tmp_path, monkeypatch):
    """`bf16_if_native` is bf16 on GPU and on CPUs with AVX512-BF16 / AMX, fp32 elsewhere (emulated bf16 is
    ~5x slower); `auto` stays fp32 on any CPU. The same answer reaches HF loading, vLLM and the trainer."""
    import deepspec.cpus as cpus
    from deepspec.config import config_from_dict
    from deepspec.data.engines.server import VLLMServer
    from deepspec.targets.load import resolve_dtype, resolve_dtype_name
    from deepspec.train.loop import autocast_context

    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma f16c\n")
    zen4 = tmp_path / "zen4"
    zen4.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n")
    sapphire = tmp_path / "spr"
    sapphire.write_text("flags\t\t: avx2 avx512f amx_bf16 amx_tile\n")
    monkeypatch.delenv("DEEPSPEC_CPU_BF16", raising=False)  # the flags are read only where the switch is unset
    assert [cpus.cpu_has_native_bf16(str(p)) for p in (avx2, zen4, sapphire)] == [False, True, True]
    assert cpus.cpu_has_native_bf16(str(tmp_path / "missing")) is False
    for forced, want in (("native", True), ("emulated", False)):  # the switch that lets one machine run both kinds
        monkeypatch.setenv("DEEPSPEC_CPU_BF16", forced)
        assert [cpus.cpu_has_native_bf16(str(p)) for p in (avx2, zen4)] == [want, want]
    monkeypatch.setenv("DEEPSPEC_CPU_BF16", "yes")
    with pytest.raises(ValueError, match="native or emulated"):
        cpus.cpu_has_native_bf16(str(avx2))
    monkeypatch.delenv("DEEPSPEC_CPU_BF16")

    real = cpus.cpu_has_native_bf16
    monkeypatch.setattr("deepspec.targets.load.default_device", lambda: "cpu")  # what VLLMServer resolves against
    for info, want in ((avx2, "float32"), (zen4, "bfloat16")):
        monkeypatch.setattr(cpus, "cpu_has_native_bf16", lambda info=info: real(str(info)))
        assert resolve_dtype_name("bf16_if_native", "cpu") == want
        assert resolve_dtype("bf16_if_native", "cpu") == getattr(torch, want)
        assert resolve_dtype_name("auto", "cpu") == "float32"
        assert resolve_dtype_name("bf16_if_native", "cuda:0") == "bfloat16"
        assert resolve_dtype_name("float16", "cpu") == "float16"
        cmd = VLLMServer("m", port=1).command()
        assert cmd[cmd.index("--dtype") + 1] == want
        cfg = config_from_dict({"train": {"precision": "bf16_if_native"}})
        with autocast_context(cfg, torch.device("cpu"))():
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == getattr(torch, want)


def test_regeneration_runs_vllm_in_the_recipes_dtype(monkeypatch):
    """The embedded target's folder says bf16; vLLM must get the recipe's resolved dtype instead (a user's
    data.regenerate.vllm_kwargs.dtype still wins)."""
    import deepspec.data.engines.vllm_engine as vllm_engine
    from deepspec.config import config_from_dict
    from deepspec.data.engines import create_engine

    seen = {}
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda *a, **kw: seen.update(kw))
    monkeypatch.setattr("deepspec.targets.resolve_target_path", lambda name: "/nowhere")
    create_engine(config_from_dict({"target": {"dtype": "auto"}}), "vllm", [])
    assert seen["vllm_kwargs"]["dtype"] == ("bfloat16" if torch.cuda.is_available() else "float32")
    create_engine(config_from_dict({"target": {"dtype": "auto"}, "data": {"regenerate": {"vllm_kwargs": {"dtype": "float16"}}}}), "vllm", [])
    assert seen["vllm_kwargs"]["dtype"] == "float16"


def test_device_map_auto_loads_a_sharded_target(tmp_path):
    """target.device_map=auto loads through accelerate's placement (everything on the CPU on a machine without GPUs)
    and captures the same taps; an unknown placement is a ConfigError."""
    from deepspec.config import config_from_dict
    from deepspec.targets import load_target_from_config, save_tiny_target

    folder = save_tiny_target(tmp_path / "moe", "qwen3_moe")
    cfg = config_from_dict({"target": {"name": str(folder), "dtype": "float32", "device_map": "auto"}})
    target = load_target_from_config(cfg.target, device="cpu")
    assert {p.device.type for p in target.model.parameters()} <= {"cpu", "cuda"}
    ref, _ = tiny_target("qwen3_moe")
    ids = torch.randint(0, 256, (1, 9))
    feats, _ = capture(target.model, ids, [0, 3])
    want, _ = capture(ref, ids, [0, 3])
    assert torch.allclose(feats, want, atol=1e-5)
    with pytest.raises(ConfigError, match="target.device_map"):
        config_from_dict({"target": {"device_map": "everywhere"}})


def test_embedded_target_is_converted_once_when_processes_ask_at_the_same_time(tmp_path, monkeypatch):
    """Ranks or test workers asking for the embedded folder at once: one converts, the others wait on the lock and
    reuse its folder (none deletes a folder another is reading). flock conflicts between two open() calls, so two
    threads stand in for two processes."""
    import json
    import threading
    import time

    import deepspec.targets.embedded as embedded

    monkeypatch.setenv("DEEPSPEC_CACHE", str(tmp_path))
    calls: list[str] = []

    def slow_convert(name, src, out):
        calls.append(name)
        time.sleep(0.3)  # the others arrive while this conversion runs
        out.mkdir(parents=True)
        (out / "deepspec_target.json").write_text(json.dumps({"format_version": embedded._FORMAT_VERSION}))

    monkeypatch.setattr(embedded, "_convert", slow_convert)
    monkeypatch.setattr(embedded, "gguf_path", lambda name: tmp_path / "model.gguf")
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(embedded.embedded_target_dir())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["smollm2-135m-instruct"] and len(got) == 3 and len(set(got)) == 1
    assert got[0] == tmp_path / "targets" / "smollm2-135m-instruct"


def test_the_conversion_parses_the_gguf_file_once_and_leaves_gguf_as_it_was(tmp_path):
    """deepspec/targets/embedded.py `_gguf_parsed_once`: within the conversion, transformers' three parses of the same
    GGUF file (tokenizer, config, weights) get one reader, and gguf's tensor-name table is built once per (arch,
    layers); after it - also after an error - gguf's own functions are back. (Measured on SmolLM2: the conversion
    9.7 s instead of 18.1 s on one core, every converted file byte-identical.)"""
    import gguf
    import numpy as np

    from deepspec.targets.embedded import _gguf_parsed_once

    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader, table = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is first and first.fields["general.architecture"].contents() == "llama"
        assert first.tensors[0].name == "token_embd.weight"
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
        assert gguf.get_tensor_name_map(arch, 2) is not gguf.get_tensor_name_map(arch, 30)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, table)
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)  # gguf's own reader again
    with pytest.raises(RuntimeError), _gguf_parsed_once():
        raise RuntimeError("a conversion that fails")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, table)


def test_the_chat_template_hash_read_from_files_is_the_loaded_tokenizers(tmp_path, smollm2_dir, monkeypatch):
    """`chat_template_hash` (training ranks and exports: no tokenizer import) equals `template_hash` of the tokenizer
    transformers loads, for the embedded target, a saved tiny one, and each way a folder can hold its templates: the
    template in tokenizer_config.json (a string, a list of named ones), chat_template.jinja overriding it, extra named
    templates beside it, none at all. A custom tokenizer class is loaded, not read."""
    import json
    import shutil

    from deepspec.targets import chat_template_hash, load_tokenizer, save_tiny_target, template_hash

    tiny = save_tiny_target(tmp_path / "tiny", "qwen3")
    jinja = (tiny / "chat_template.jinja").read_text()
    config = json.loads((tiny / "tokenizer_config.json").read_text())

    def variant(name: str, *, in_config=None, jinja_file: str | None = None, extra: dict | None = None, **more) -> Path:
        folder = tmp_path / name
        shutil.copytree(tiny, folder)
        (folder / "chat_template.jinja").unlink()
        conf = {k: v for k, v in config.items() if k != "chat_template"} | more
        if in_config is not None:
            conf["chat_template"] = in_config
        (folder / "tokenizer_config.json").write_text(json.dumps(conf))
        if jinja_file is not None:
            (folder / "chat_template.jinja").write_text(jinja_file)
        for key, text in (extra or {}).items():
            (folder / "additional_chat_templates").mkdir(exist_ok=True)
            (folder / "additional_chat_templates" / f"{key}.jinja").write_text(text)
        return folder

    folders = [
        smollm2_dir, tiny,
        variant("in-config", in_config="{{ messages[0]['content'] }}"),
        variant("named-list", in_config=[{"name": "default", "template": jinja}, {"name": "tool_use", "template": "{{ tools }}"}]),
        variant("file-wins", in_config="{{ 'from the config' }}", jinja_file=jinja + "\r\n"),
        variant("extra", jinja_file=jinja, extra={"tool_use": "{{ tools | tojson }}"}),
        variant("extra-only", in_config="{{ 'ignored' }}", extra={"rag": "{{ documents }}"}),
        variant("none"),
    ]
    import deepspec.targets.load as load

    loaded = []
    monkeypatch.setattr(load, "load_tokenizer", lambda name, *a: loaded.append(name) or load_tokenizer(name, *a))
    hashes = [chat_template_hash(str(f)) for f in folders]
    assert not loaded  # every one read from its files
    assert hashes == [template_hash(load_tokenizer(str(f))) for f in folders]
    assert len(set(hashes)) == len(hashes)  # each variant is a template of its own: the comparison could fail
    custom = variant("custom-class", in_config="{{ 'custom' }}", auto_map={"AutoTokenizer": ["nowhere.Tokenizer", None]})
    assert chat_template_hash(str(custom)) == template_hash(load_tokenizer(str(custom))) and loaded == [str(custom)]


def test_a_recorded_target_config_builds_every_draft_as_the_resolved_one(tmp_path, monkeypatch, smollm2_dir):
    """Training ranks read the target's config numbers recorded by the first process that resolved it (no transformers
    import): for the embedded target and every tiny family, each recorded field equals the resolved config's, every
    algorithm builds the same draft architecture and taps from either, and the adapter and stream count agree. An
    unrecorded field raises instead of defaulting; a changed config.json is resolved again; deepspec's own tiny model
    type is never recorded."""
    import json

    from deepspec.config.model import ModelConfig
    from deepspec.drafts import get_algorithm
    from deepspec.drafts.registry import available_algorithms
    from deepspec.targets import save_tiny_target
    from deepspec.targets.adapters import adapter_for
    from deepspec.targets.hf_config import FIELDS, RecordedConfig, target_config

    monkeypatch.setenv("DEEPSPEC_CACHE", str(tmp_path / "cache"))
    folders = [smollm2_dir] + [save_tiny_target(tmp_path / f, f) for f in tiny_families() if f != "tiny_mhc"]
    for folder in folders:
        real = target_config(str(folder))
        recorded = target_config(str(folder))
        assert not isinstance(real, RecordedConfig) and isinstance(recorded, RecordedConfig), folder
        for name in FIELDS:
            assert json.dumps(getattr(recorded, name, "absent")) == json.dumps(getattr(real, name, "absent")), (folder, name)
        assert getattr(recorded, "text_config", None) is None
        assert adapter_for(recorded) is adapter_for(real) and adapter_for(recorded).hc_mult(recorded) == adapter_for(real).hc_mult(real)
        for algorithm in available_algorithms():
            built = [get_algorithm(algorithm).from_target_config(c, ModelConfig(algorithm=algorithm)) for c in (real, recorded)]
            assert built[0].arch == built[1].arch and built[0].taps == built[1].taps, (folder, algorithm)
    with pytest.raises(LookupError, match="not recorded"):
        getattr(recorded, "pad_token_id", None)

    edited = tmp_path / "llama"  # another MLP width in config.json: resolved again, not read from the old record
    conf = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**conf, "intermediate_size": conf["intermediate_size"] * 2}))
    again = target_config(str(edited))
    assert not isinstance(again, RecordedConfig) and again.intermediate_size == 2 * conf["intermediate_size"]
    mhc = save_tiny_target(tmp_path / "mhc", "tiny_mhc")
    assert not any(isinstance(target_config(str(mhc)), RecordedConfig) for _ in range(2))
