"""Acceptance by context length and thinking mode: buckets of prompt length, the template's thinking switch, reports."""

from __future__ import annotations

import json
import shutil

import pytest

from test_eval_runner import datasets_dir, tiny_ckpt  # noqa: F401 - module fixtures reused: a draft checkpoint, benchmark files
from test_metrics import _stats  # AcceptanceStats from (proposed, accepted) rounds

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Qwen3's behaviour in ChatML: thinking is on unless enable_thinking is false, which pre-fills an empty think block.
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)

# (prompt tokens, [(proposed, accepted), ...] per verify round) of five answers
ANSWERS = [
    (10, [(3, 3), (3, 0)]),
    (255, [(3, 1)]),
    (256, [(3, 2), (3, 3), (2, 2)]),
    (1023, [(3, 0)]),
    (20000, [(3, 3), (3, 1)]),
]


def test_bucket_ladder_and_per_bucket_figures_equal_the_subsets():
    from deepspec.eval.context_length import ContextLengthStats, bucket_labels, bucket_of

    edges = (256, 1024, 4096, 16384)
    assert bucket_labels(edges) == ["<256", "256-1k", "1k-4k", "4k-16k", ">=16k"]
    assert [bucket_of(n, edges) for n in (0, 255, 256, 1023, 1024, 16383, 16384)] == \
        ["<256", "<256", "256-1k", "256-1k", "1k-4k", "4k-16k", ">=16k"]
    by_len = ContextLengthStats(edges)
    for n, rounds in ANSWERS:
        by_len.add(n, _stats(rounds))
    got = by_len.summary()
    assert list(got) == ["<256", "256-1k", ">=16k"]  # empty buckets left out, ladder order
    # each bucket's figures are those of its answers' rounds alone
    for label, members in (("<256", ANSWERS[:2]), ("256-1k", ANSWERS[2:4]), (">=16k", ANSWERS[4:])):
        by_hand = _stats([r for _, rounds in members for r in rounds]).summary()
        mine = {k: v for k, v in got[label].items() if k in by_hand}
        assert json.dumps(mine, sort_keys=True) == json.dumps(by_hand, sort_keys=True)  # same counters: equal to the bit (NaN too)
        assert got[label]["prompts"] == len(members)
        assert (got[label]["prompt_tokens_min"], got[label]["prompt_tokens_max"]) == (min(n for n, _ in members), max(n for n, _ in members))
    # <256 worked out: rounds A = 3, 0, 1 of 3 proposed -> tau (4 + 1 + 2) / 3, acc0 2/3, acc_cond@2 = 2/2 ... survival@3 1/3
    lo = got["<256"]
    assert lo["rounds"] == 3 and lo["tau"] == pytest.approx(7 / 3) and lo["acc0"] == pytest.approx(2 / 3)
    assert lo["acc_cond"] == pytest.approx([2 / 3, 1 / 2, 1.0]) and lo["survival"] == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert lo["E[A]@S3"] == pytest.approx(4 / 3)


def test_buckets_pool_to_the_split_and_splits_pool_to_overall():
    from deepspec.eval.context_length import ContextLengthStats, report

    a, b = ContextLengthStats(), ContextLengthStats()
    for n, rounds in ANSWERS[:3]:
        a.add(n, _stats(rounds))
    for n, rounds in ANSWERS[2:]:
        b.add(n, _stats(rounds))
    assert a.pooled().to_dict() == _stats([r for _, rs in ANSWERS[:3] for r in rs]).to_dict()
    # a worker's counters round-trip through JSON and merge by adding
    assert ContextLengthStats.from_dict(json.loads(json.dumps(a.to_dict()))).to_dict() == a.to_dict()
    block = report({"gsm8k": a, "mt-bench": b}, ["gsm8k", "mt-bench", "mbpp"], a.edges)
    assert list(block["tasks"]) == ["gsm8k", "mt-bench"] and block["buckets"][0] == "<256"
    total = sum(r["rounds"] for r in block["overall"].values())
    assert total == sum(len(rs) for _, rs in ANSWERS) + len(ANSWERS[2][1])  # answer 2 is in both splits
    assert block["overall"]["256-1k"]["rounds"] == block["tasks"]["gsm8k"]["256-1k"]["rounds"] + block["tasks"]["mt-bench"]["256-1k"]["rounds"]
    with pytest.raises(ValueError, match="cut at"):
        a.merge(ContextLengthStats((100,)))


def test_markdown_and_summary_tables(tmp_path):
    from deepspec.config import load_config
    from deepspec.eval.context_length import ContextLengthStats, report
    from deepspec.eval.report import markdown
    from deepspec.pipeline import RecipeResult, summary_json, summary_markdown

    by_len = ContextLengthStats()
    for n, rounds in ANSWERS:
        by_len.add(n, _stats(rounds))
    pooled = by_len.pooled().summary()
    results = {"meta": {"algorithm": "eagle3", "max_new_tokens": 16}, "tasks": {"gsm8k": {"samples": 5, **pooled}},
               "overall": pooled, "by_context_length": report({"gsm8k": by_len}, ["gsm8k"], by_len.edges)}
    md = markdown(results)
    assert "## By context length" in md
    assert "| gsm8k | <256 | 2 | 3 | 0.667 | 0.500 | 1.000 |" in md
    assert "| gsm8k | 1k-4k |" not in md and "| **overall (pooled)** | >=16k | 1 | 2 |" in md
    summary = summary_markdown([RecipeResult("r.yaml", load_config(None, []), results=results)])
    assert "## gsm8k by context length" in summary and "| eagle3 | 256-1k | 2 | 4 | 0.750 |" in summary
    assert summary_json([RecipeResult("r.yaml", load_config(None, []), results=results)])["recipes"][0]["by_context_length"]["split"] == "gsm8k"


def test_thinking_switch_probe_and_plan():
    from deepspec.eval.thinking import plan, template_has_switch
    from deepspec.targets import tiny_tokenizer

    chatml = tiny_tokenizer()
    assert not template_has_switch(chatml)
    p = plan(chatml, {}, [True, False], ["heldout"])
    assert not p.switch and p.to_decode() == {}  # one mode: the run as configured
    qwen_like = tiny_tokenizer()
    qwen_like.chat_template = THINKING_TEMPLATE
    assert template_has_switch(qwen_like)
    p = plan(qwen_like, {"enable_thinking": False}, [True, False], ["heldout"])
    assert p.switch and p.reuse_main == {"on": False, "off": True}
    assert p.to_decode() == {"on": {"enable_thinking": True}}


def _thinking_target(tiny_llama_dir, root):
    """The tiny target with a chat template that has a thinking switch."""
    path = root / "tiny-llama-thinking"
    shutil.copytree(tiny_llama_dir, path)
    cfg_path = path / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["chat_template"] = THINKING_TEMPLATE
    cfg_path.write_text(json.dumps(tok_cfg))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


def test_eval_reports_by_length_and_thinking_mode(tiny_ckpt, datasets_dir, tmp_path, tiny_llama_dir):  # noqa: F811
    from deepspec.config import load_config
    from deepspec.eval.runner import evaluate

    target = _thinking_target(tiny_llama_dir, tmp_path)
    out = tmp_path / "eval"
    cfg = load_config(None, [
        f"eval.datasets_dir={datasets_dir}", "eval.tasks=[gsm8k,mt-bench]", "eval.max_new_tokens=6", "eval.num_draft_tokens=3",
        "eval.max_samples=2", "eval.measure_speedup=false", f"eval.output_dir={out}", "logging.wandb=false",
        f"target.name={target}", "eval.context_length_buckets=[64]", "eval.thinking_modes=[on,off]",
    ])
    res = evaluate(cfg, tiny_ckpt)
    on_disk = json.loads((out / "results.json").read_text())
    by_len = on_disk["by_context_length"]
    assert by_len["buckets"] == ["<64", ">=64"] and set(by_len["tasks"]) == {"gsm8k", "mt-bench"}
    for task in ("gsm8k", "mt-bench"):  # every answer's rounds are in exactly one bucket
        assert sum(b["rounds"] for b in by_len["tasks"][task].values()) == res["tasks"][task]["rounds"]
    assert sum(b["prompts"] for b in by_len["overall"].values()) == 2 + 2  # two gsm8k answers, mt-bench's two turns
    assert {"<64", ">=64"} == set(by_len["tasks"]["mt-bench"])  # turn 2 carries turn 1 and its answer: a longer prompt
    # thinking: no held-out split here, so every task; the default kwargs are thinking off, so "off" is the main run
    # and only "on" decodes again
    th = on_disk["by_thinking_mode"]
    assert th["template_switch"] and list(th["modes"]) == ["on", "off"]
    assert th["modes"]["on"]["chat_template_kwargs"] == {"enable_thinking": True} and not th["modes"]["on"]["reused_main_run"]
    assert th["modes"]["off"]["reused_main_run"] and th["modes"]["off"]["overall"]["rounds"] == res["overall"]["rounds"]
    assert set(th["modes"]["on"]["tasks"]) == {"gsm8k", "mt-bench"} and th["modes"]["on"]["overall"]["rounds"] > 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(s.get("thinking", "main") for s in samples) == ["main"] * 3 + ["on"] * 3
    on = next(s for s in samples if s.get("thinking") == "on" and s["task"] == "gsm8k")
    main = next(s for s in samples if "thinking" not in s and s["task"] == "gsm8k")
    # thinking off (the main run) pre-fills an empty think block, one byte token per character here
    assert main["turns"][0]["prompt_tokens"] == on["turns"][0]["prompt_tokens"] + len("<think>\n\n</think>\n\n")
    md = (out / "results.md").read_text()
    assert "## By context length" in md and "| gsm8k / thinking off |" in md and "| gsm8k / thinking on |" in md
    assert (out / "acceptance_by_length.png").read_bytes()[:4] == b"\x89PNG"
    # the main figures are those of the configured render, untouched by the extra passes
    assert res["overall"]["rounds"] == res["tasks"]["gsm8k"]["rounds"] + res["tasks"]["mt-bench"]["rounds"]
