"""SGLang exports, checked by SGLang's own code: its draft classes are built on CPU from our config.json,
our safetensors go through its load_weights (every tensor consumed, every parameter set), and one
forward is compared with ours (tests/sglang_probe.py, run in a subprocess). SGLang's sources come from
the registry via scripts/sglang_side.sh; the test skips only when that install fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepspec.config.model import ModelConfig
from deepspec.drafts import get_algorithm
from deepspec.errors import ConfigError
from deepspec.export.writers import export_draft
from deepspec.targets import tiny_config
from random_drafts import random_draft_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _ckpt(tmp_path, family, algorithm, name="ckpt", **fields):
    # model.qk_norm=false in `fields` gives a Qwen3 target Llama-style EAGLE-3 layers, through the recipe's own path
    return random_draft_checkpoint(tmp_path / name, family, algorithm, markov_rank=8, **fields)


def _probe(side, jobs: list[tuple]) -> list[dict]:
    """Run SGLang's classes on (checkpoint, export, verify mode) jobs in one subprocess (one SGLang import)."""
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "sglang_probe.py"), side, *("::".join(map(str, j)) for j in jobs)],
                       capture_output=True, text=True, timeout=900)
    line = [x for x in r.stdout.splitlines() if x.startswith("SGLANG_PROBE ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    return json.loads(line[-1][len("SGLANG_PROBE "):])


CASES = {
    # EAGLE-3.1 with 4 taps (embeddings + 3 layers), a draft vocabulary and two layers
    "eagle31-llama-4taps-2layers": ("llama", "eagle3", dict(target_layer_ids=[-1, 0, 2, 3], draft_vocab_size=100, num_draft_layers=2,
                                                            fc_norm=True, norm_output=True)),
    # EAGLE-3 (no fc_norm) for a Qwen3 target, Llama-style draft layers, full vocabulary
    "eagle3-qwen3-target": ("qwen3", "eagle3", dict(fc_norm=False, norm_output=False, qk_norm=False)),
    "dflash": ("qwen3", "dflash", dict(num_draft_layers=2, mask_token_id=259)),
    "dspark-vanilla": ("qwen3", "dspark", dict(mask_token_id=259)),
    "dspark-rnn": ("qwen3", "dspark", dict(mask_token_id=259, markov_head_type="rnn")),
    "dspark-gated": ("qwen3", "dspark", dict(mask_token_id=259, markov_head_type="gated", confidence_head_with_markov=False)),
}


@pytest.fixture(scope="module")
def sglang_reports(sglang_side, tmp_path_factory):
    """Every case exported and probed by SGLang's code in one subprocess: {case: (draft, export config, report)}.
    `cap-accept` is SGLang's verify mode in which DSpark builds its confidence head (ignored by the others);
    `dspark-no-confidence` runs in SGLang's default `static` mode, which builds none."""
    root = tmp_path_factory.mktemp("sglang")
    cases = dict(CASES, **{"dspark-no-confidence": ("qwen3", "dspark", dict(mask_token_id=259, enable_confidence_head=False))})
    built, jobs = {}, []
    for case, (family, algorithm, fields) in cases.items():
        draft, ckpt = _ckpt(root / case, family, algorithm, **fields)
        out = export_draft(ckpt, root / case / "sglang", "sglang", dtype="float32")
        built[case] = (draft, json.loads((out / "config.json").read_text()), out)
        jobs.append((ckpt, out, "static" if case == "dspark-no-confidence" else "cap-accept"))
    reports = _probe(sglang_side, jobs)
    return {case: (*built[case], rep) for case, rep in zip(cases, reports)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES) + ["dspark-no-confidence"])
def test_sglang_loads_and_runs_our_export(case, sglang_reports):
    draft, cfg, out, rep = sglang_reports[case]
    algorithm = cfg["deepspec"]["algorithm"]
    allowed_unset = {"model.embed_tokens.weight"}  # shared with the target by SGLang's EAGLE worker
    allowed_unset |= {f"model.layers.{i}.input_layernorm.weight" for i in range(1, 4)}  # SGLang's deeper layers use hidden_norm
    # d2t becomes SGLang's hot_token_id (no parameter; checked below); t2d is read by nobody (SGLang skips it)
    assert rep["unconsumed"] == (["d2t", "t2d"] if "d2t" in _tensors(out) else []), rep
    assert set(rep["unset"]) <= allowed_unset, rep["unset"]
    diffs = rep["max_abs_diff"]
    print(case, rep["class"], diffs)
    assert all(v < 1e-4 for v in diffs.values()), (rep["class"], diffs)
    if algorithm == "eagle3":
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(draft.taps)  # SGLang adds the 1
        assert "eagle_aux_hidden_state_layer_ids" not in cfg
        assert rep["hot_token_id_matches_d2t"] is True
    else:
        assert cfg["dflash_config"]["target_layer_ids"] == list(draft.taps)
    if algorithm == "dspark":
        kind = cfg["markov_head_type"]
        assert rep["markov_head"] == {"vanilla": "VanillaMarkov", "rnn": "RNNHead", "gated": "GatedMarkovHead"}[kind]
        assert "speculators_model_type" not in cfg and cfg["architectures"] == ["Qwen3DSparkModel"]
        # the confidence head was built and compared, except in static mode for a draft without one
        assert ("confidence_logit" in diffs) is (case != "dspark-no-confidence")


def _tensors(out):
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


def test_sglang_source_still_adds_one_to_eagle3_and_dflash_layer_ids(sglang_side):
    """The export writes our taps because SGLang's targets add 1 themselves; fail loudly if that changes."""
    models = Path(sglang_side) / "sglang" / "srt" / "models"
    for target in ("llama.py", "qwen3.py"):
        src = (models / target).read_text()
        for hook in ("def set_eagle3_layers_to_capture", "def set_dflash_layers_to_capture"):
            body = src.split(hook, 1)[1].split("\n    def ", 1)[0]
            assert "val + 1 for val in layer_ids" in body, (target, hook)
    runner = (Path(sglang_side) / "sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py").read_text()
    assert 'eagle_config[\n                "eagle_aux_hidden_state_layer_ids"\n            ]' in runner


def test_the_side_folder_is_per_python_and_the_check_finds_it(sglang_side, monkeypatch):
    """The default side folder carries the Python it was installed for (orjson in it is compiled for one: a folder
    shared by a 3.11 and a 3.12 interpreter made every SGLang check fail under the other), and `deepspec check` looks
    for the one scripts/sglang_side.sh made for the running Python."""
    from deepspec.export.sglang_side import find_side_dir

    tag = f"-py{sys.version_info[0]}{sys.version_info[1]}"
    assert Path(sglang_side).name.endswith(tag), sglang_side
    monkeypatch.delenv("DEEPSPEC_SGLANG_SIDE", raising=False)  # another test module may have set it to that folder
    assert find_side_dir() == Path(sglang_side)
    monkeypatch.setattr(sys, "version_info", (3, 99, 0))  # another Python: not this folder
    assert find_side_dir() is None


@pytest.mark.parametrize("family, fields, match", [
    ("qwen3", dict(), "q/k RMSNorms"),  # a Qwen3 target's EAGLE-3 draft has Qwen3-style layers by default
    ("llama", dict(norm_before_residual=True), "norm_before_residual"),
    ("llama", dict(layer_types=["sliding_attention"], sliding_window=8), "sliding-window"),
])
def test_sglang_refuses_eagle3_it_cannot_run(tmp_path, family, fields, match):
    _, ckpt = _ckpt(tmp_path, family, "eagle3", **fields)
    with pytest.raises(ConfigError, match=match):
        export_draft(ckpt, tmp_path / "out", "sglang")
    assert export_draft(ckpt, tmp_path / "vllm", "vllm").is_dir()  # vLLM runs it




def test_sglang_block_export_names_its_mask_token(tmp_path, tiny_qwen3_dir):
    """SGLang looks dflash_config.mask_token up in the target's tokenizer (default `<|MASK|>`) and refuses to start
    when that names another id than mask_token_id: the export names our id's own token."""
    from deepspec.targets.load import load_tokenizer

    for algorithm in ("dflash", "dspark"):
        _, ckpt = _ckpt(tmp_path / algorithm, "qwen3", algorithm, mask_token_id=259)
        cfg = json.loads((export_draft(ckpt, tmp_path / algorithm / "out", "sglang", target=str(tiny_qwen3_dir)) / "config.json").read_text())
        token = cfg["dflash_config"]["mask_token"]
        assert load_tokenizer(str(tiny_qwen3_dir)).get_vocab()[token] == cfg["dflash_config"]["mask_token_id"] == 259


def test_sglang_refuses_sliding_window_block_drafts(tmp_path):
    _, ckpt = _ckpt(tmp_path, "qwen3", "dflash", mask_token_id=259, layer_types=["sliding_attention"], sliding_window=8)
    with pytest.raises(ConfigError, match="sliding-window"):
        export_draft(ckpt, tmp_path / "out", "sglang")


def test_sglang_refuses_multi_stream_taps(tmp_path):
    _, ckpt = _ckpt(tmp_path, "llama", "eagle3")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["deepspec"]["arch"]["target_hc_mult"] = 4
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="4-stream"):
        export_draft(ckpt, tmp_path / "out", "sglang")


def test_qk_norm_override_builds_llama_style_eagle3_layers_and_is_refused_for_block_drafts():
    from deepspec.errors import ConfigError

    default = get_algorithm("eagle3").from_target_config(tiny_config("qwen3"), ModelConfig(algorithm="eagle3", target_layer_ids=[0, 2, 3]))
    llama_style = get_algorithm("eagle3").from_target_config(
        tiny_config("qwen3"), ModelConfig(algorithm="eagle3", target_layer_ids=[0, 2, 3], qk_norm=False))
    assert default.arch.qk_norm and default.midlayer.self_attn.q_norm is not None
    assert not llama_style.arch.qk_norm and llama_style.midlayer.self_attn.q_norm is None
    with pytest.raises(ConfigError, match="model.qk_norm=false is not available for dflash"):
        ModelConfig(algorithm="dflash", qk_norm=False).validate()
