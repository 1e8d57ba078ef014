"""The eval stage end to end on a tiny target: checkpoint provenance -> benchmarks -> merged reports."""

from __future__ import annotations

import json

import pytest
import torch


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, tiny_llama_dir):
    """A random EAGLE-3 draft checkpoint whose provenance names the tiny target folder."""
    from transformers import AutoModelForCausalLM

    from deepspec.config.model import ModelConfig
    from deepspec.drafts.checkpoint import save_draft
    from deepspec.drafts.registry import get_algorithm

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    torch.manual_seed(0)
    draft = get_algorithm("eagle3").from_target_config(target.config, ModelConfig(algorithm="eagle3"))
    out = tmp_path_factory.mktemp("ckpt") / "step_3"
    save_draft(draft, out, provenance={"target": "tiny-llama", "target_path": str(tiny_llama_dir)})
    return out


@pytest.fixture(scope="module")
def datasets_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval_datasets")
    (d / "gsm8k.jsonl").write_text("\n".join(json.dumps({"turns": [f"What is {i} + {i}?"]}) for i in range(3)) + "\n")
    (d / "mt-bench.jsonl").write_text(json.dumps({"turns": ["Name a color.", "Now name another one."], "id": "q1"}) + "\n")
    return d


def _cfg(datasets_dir, out, *extra):
    from deepspec.config import load_config

    return load_config(None, [
        f"eval.datasets_dir={datasets_dir}", "eval.tasks=[gsm8k,mt-bench,mbpp]", "eval.max_new_tokens=10",
        "eval.num_draft_tokens=3", f"eval.output_dir={out}", "logging.wandb=false", *extra,
    ])


def test_evaluate_writes_reports(tiny_ckpt, datasets_dir, tmp_path, tiny_llama_dir):
    from deepspec.eval.runner import evaluate

    out = tmp_path / "eval"
    res = evaluate(_cfg(datasets_dir, out), tiny_ckpt, run_dir=tmp_path / "run", step=3)
    # target taken from the checkpoint's provenance
    assert res["meta"]["target"]["target_path"] == str(tiny_llama_dir)
    for name in ("results.json", "results.md", "acceptance.png", "samples.jsonl", "config.yaml"):
        assert (out / name).is_file(), name
    assert (out / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["tasks"]["gsm8k"]["samples"] == 3
    # mbpp has no file: reported as skipped, not silently dropped
    assert "skipped" in on_disk["tasks"]["mbpp"]
    assert "mbpp" in (out / "results.md").read_text()
    # overall counters are the sum of the per-task ones
    t = res["tasks"]
    assert res["overall"]["rounds"] == t["gsm8k"]["rounds"] + t["mt-bench"]["rounds"]
    assert res["overall"]["accepted_tokens"] == t["gsm8k"]["accepted_tokens"] + t["mt-bench"]["accepted_tokens"]
    assert res["overall"]["tau"] == pytest.approx(1 + res["overall"]["accepted_tokens"] / res["overall"]["rounds"])
    # greedy, fp32: every turn identical to target-only decoding
    m = res["greedy_outputs_match_target"]
    assert m["turns"] == 3 + 2 and m["matched_turns"] == m["turns"]
    assert res["overall"]["speedup"] > 0 and res["overall"]["target_tokens"] == res["overall"]["spec_tokens"]
    # MT-Bench: both turns asked, the second after the model's own first answer
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    mt = [s for s in samples if s["task"] == "mt-bench"][0]
    assert len(mt["turns"]) == 2 and mt["turns"][1]["prompt_tokens"] > mt["turns"][0]["prompt_tokens"] + mt["turns"][0]["new_tokens"]
    # tensorboard event file in the run dir
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_target_override_and_mismatch(tiny_ckpt, datasets_dir, tmp_path, tiny_qwen3_dir):
    from deepspec.errors import CheckpointError
    from deepspec.eval.runner import evaluate

    # a target of another width is refused with a CheckpointError naming the fix
    from deepspec.targets import save_tiny_target

    wide = save_tiny_target(tmp_path / "wide", "llama", hidden_size=96, head_dim=24)
    cfg = _cfg(datasets_dir, tmp_path / "e", f"target.name={wide}", "eval.tasks=[gsm8k]", "eval.max_samples=1")
    with pytest.raises(CheckpointError, match="hidden size 96"):
        evaluate(cfg, tiny_ckpt)


@pytest.mark.slow
def test_two_workers_merge_like_one(tiny_ckpt, datasets_dir, tmp_path):
    """2 spawned CPU workers, samples strided: merged counters equal the single-worker run (greedy)."""
    from deepspec.eval.runner import evaluate

    one = evaluate(_cfg(datasets_dir, tmp_path / "one", "eval.measure_speedup=false"), tiny_ckpt)
    two = evaluate(_cfg(datasets_dir, tmp_path / "two", "eval.measure_speedup=false", "eval.num_workers=2"), tiny_ckpt)
    for key in ("rounds", "proposed_tokens", "accepted_tokens", "generated_tokens"):
        assert one["overall"][key] == two["overall"][key]
    assert two["meta"]["num_workers"] == 2


def test_cli_flags_become_overrides(tiny_ckpt, datasets_dir, tmp_path):
    from deepspec.cli import build_parser
    from deepspec.eval.cli import load_eval_config

    args = build_parser().parse_args([
        "eval", str(tiny_ckpt), "--tasks", "gsm8k", "mt-bench", "--max-samples", "2", "--temperature", "0.7", "--nproc", "2",
        "--target", "/some/where", "--opts", "eval.max_new_tokens=5",
    ])
    cfg = load_eval_config(args)
    assert cfg.eval.tasks == ["gsm8k", "mt-bench"] and cfg.eval.max_samples == 2 and cfg.eval.temperature == 0.7
    assert cfg.eval.num_workers == 2 and cfg.target.name == "/some/where" and cfg.eval.max_new_tokens == 5


def test_resolve_target_name(smollm2_dir, tiny_llama_dir):
    from deepspec.config import load_config
    from deepspec.eval.runner import resolve_target_name

    meta = {"provenance": {"target": "smollm2-135m-instruct", "target_path": str(smollm2_dir)}}
    assert resolve_target_name(load_config(None, []), meta) == "smollm2-135m-instruct"  # the recipe's spelling is kept
    other = {"provenance": {"target": "org/not-local", "target_path": str(tiny_llama_dir)}}
    assert resolve_target_name(load_config(None, []), other) == str(tiny_llama_dir)
    assert resolve_target_name(load_config(None, [f"target.name={tiny_llama_dir}"]), meta) == str(tiny_llama_dir)


def test_task_max_samples_caps_one_task_and_refuses_unknown_names(datasets_dir, tmp_path):
    from deepspec.errors import ConfigError
    from deepspec.eval.runner import build_work

    items, info = build_work(_cfg(datasets_dir, tmp_path, "eval.max_samples=2", "eval.task_max_samples={gsm8k: 1}"))
    assert info["gsm8k"]["samples"] == 1 and info["mt-bench"]["samples"] == 1
    assert sum(item.task == "gsm8k" for item in items) == 1
    items, info = build_work(_cfg(datasets_dir, tmp_path, "eval.max_samples=2"))
    assert info["gsm8k"]["samples"] == 2
    with pytest.raises(ConfigError, match="held_out"):
        build_work(_cfg(datasets_dir, tmp_path, "eval.task_max_samples={held_out: 24}"))


def test_custom_task_and_named_heldout_split(tiny_ckpt, datasets_dir, tmp_path):
    """A user's JSONL file (single- and multi-turn rows, three shapes) and a held-out split by kind run through
    the eval like the benchmarks: named after the file stem / split, with the headline metric names."""
    from deepspec.eval.runner import evaluate

    mine = tmp_path / "my_prompts.jsonl"
    mine.write_text("\n".join(json.dumps(r) for r in [
        {"turns": ["Say hi.", "Say it again."]},
        {"conversations": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to 3."}]},
        {"prompt": "Name a fruit."},
    ]) + "\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "heldout.agentic.jsonl").write_text(json.dumps(
        {"id": "t1", "conversations": [{"role": "system", "content": "Functions: [get_time]"}, {"role": "user", "content": "Time?"}]}) + "\n")
    out = tmp_path / "eval"
    cfg = _cfg(datasets_dir, out, f"eval.tasks=[gsm8k,{mine},'heldout:agentic']", "eval.measure_speedup=false",
               f"data.dir={data}", "eval.task_max_samples={my_prompts: 3}")
    res = evaluate(cfg, tiny_ckpt)
    assert list(res["tasks"]) == ["gsm8k", "my_prompts", "heldout:agentic"]
    t = res["tasks"]["my_prompts"]
    assert t["samples"] == 3 and t["file"] == str(mine)
    for name in ("acc0", "acc_cond@1", "E[A]@S3", "E[A]@S7", "tau@3"):
        assert name in t and name in res["tasks"]["heldout:agentic"]
    assert t["acc0"] == t["acc_cond"][0] and t["tau@3"] == pytest.approx(1 + t["E[A]@S3"])
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    multi = [s for s in samples if s["task"] == "my_prompts" and s["index"] == 0][0]
    assert len(multi["turns"]) == 2
    # the system message is part of the prompt: the tool-use row renders longer than its user turn alone
    from transformers import AutoTokenizer

    from deepspec.data.chat import render_prompt

    tok = AutoTokenizer.from_pretrained(json.loads((out / "results.json").read_text())["meta"]["target"]["target_path"])
    agentic = [s for s in samples if s["task"] == "heldout:agentic"][0]
    assert agentic["turns"][0]["prompt_tokens"] == len(render_prompt(
        tok, [{"role": "system", "content": "Functions: [get_time]"}, {"role": "user", "content": "Time?"}], {}))
    md = (out / "results.md").read_text()
    assert "| my_prompts | 3 | 10 |" in md and "E[A]@S3" in md and "tau@3" in md


def test_custom_task_errors(datasets_dir, tmp_path):
    from deepspec.errors import ConfigError, DataError
    from deepspec.eval.runner import build_work

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"conversations": [{"role": "user"}]}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: message 0 needs a 'role' and a string 'content'"):
        build_work(_cfg(datasets_dir, tmp_path, f"eval.tasks=[{bad}]"))
    bad.write_text('{"turns": ["ok"]}\n\n{"turns": ["a"],\n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: invalid JSON"):
        build_work(_cfg(datasets_dir, tmp_path, f"eval.tasks=[{bad}]"))
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: no prompt found"):
        build_work(_cfg(datasets_dir, tmp_path, f"eval.tasks=[{bad}]"))
    js = tmp_path / "rows.json"
    js.write_text('[{"prompt": "a"}, {"turns": []}]')
    with pytest.raises(DataError, match=r"rows.json#1: 'turns' must be a non-empty list"):
        build_work(_cfg(datasets_dir, tmp_path, f"eval.tasks=[{js}]"))
    with pytest.raises(DataError, match="does not exist"):
        build_work(_cfg(datasets_dir, tmp_path, f"eval.tasks=[{tmp_path / 'missing.jsonl'}]"))
    (tmp_path / "gsm8k.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(ConfigError, match="more than once"):
        build_work(_cfg(datasets_dir, tmp_path, f"eval.tasks=[gsm8k,{tmp_path / 'gsm8k.jsonl'}]"))
    # a held-out split that was not built is reported as skipped, not silently dropped
    items, info = build_work(_cfg(datasets_dir, tmp_path, "eval.tasks=[gsm8k,'heldout:general']", f"data.dir={tmp_path / 'd'}"))
    assert "skipped" in info["heldout:general"] and "data.prompts.sources" in info["heldout:general"]["skipped"]
