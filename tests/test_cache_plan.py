"""The tokenized plan is made once per input and shared through the data folder: a second process (trainer rank,
producer, resumed run) loads exactly what the first tokenized, two processes started together tokenize once, and a
changed data file or rendering setting is a new plan, never a stale one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def _config(tmp_path: Path, target: Path, *opts: str):
    from deepspec.config import load_config
    from deepspec.data.jsonl import write_jsonl_atomic

    cfg = load_config(None, [f"target.name={target}", f"data.dir={tmp_path / 'data'}", "cache.max_length=96", *opts])
    if not cfg.regenerated_path.exists():
        rows = [{"id": f"s{i}", "conversations": [{"role": "user", "content": f"count to {i}"},
                                                  {"role": "assistant", "content": " ".join(str(j) for j in range(i + 3))}]}
                for i in range(40)]
        write_jsonl_atomic(cfg.regenerated_path, rows)
    return cfg


def _fields(plan) -> tuple:
    return ([(s.id, s.length, s.offset, s.truncated) for s in plan.samples], plan.counts, plan.shards, plan.signature,
            None if plan.token_counts is None else plan.token_counts.tolist())


def test_a_plan_is_tokenized_once_and_loaded_as_made(tmp_path, tiny_llama_dir, logs):
    from deepspec.data.cache.plan import load_plan_inputs, make_plan

    cfg = _config(tmp_path, tiny_llama_dir)
    tok, tconf = load_plan_inputs(cfg)
    first = make_plan(cfg, "train", tok, tconf, count_tokens=True)
    assert not [m for m in logs.messages if "loaded from" in m]
    stored = list((cfg.data_dir / ".plans").glob("train-*.npz"))
    assert len(stored) == 1
    second = make_plan(cfg, "train", tok, tconf, count_tokens=True)
    assert [m for m in logs.messages if "loaded from" in m and str(stored[0]) in m]
    assert _fields(second) == _fields(first) and any(s.truncated for s in first.samples)
    assert int(np.asarray(first.token_counts).sum()) == first.counts["loss_tokens"] > 0
    # another rendering setting, another plan; the same data appended to, another plan
    shorter = make_plan(_config(tmp_path, tiny_llama_dir, "cache.max_length=64"), "train", tok, tconf)
    assert shorter.counts["truncated"] > first.counts["truncated"]
    with open(cfg.regenerated_path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"id": "late", "conversations": [{"role": "user", "content": "one more"},
                                                            {"role": "assistant", "content": "a b c d e f g h i j"}]}) + "\n")
    grown = make_plan(cfg, "train", tok, tconf, count_tokens=True)
    assert [s.id for s in grown.samples][-1] == "late" and len(grown.samples) == len(first.samples) + 1
    assert len(list((cfg.data_dir / ".plans").glob("train-*.npz"))) == 3


CHILD = """
import sys
from deepspec.config import load_config
from deepspec.data.cache.plan import plan_split
from deepspec.log import setup_logging
setup_logging()
cfg = load_config(None, [f"target.name={sys.argv[1]}", f"data.dir={sys.argv[2]}", "cache.max_length=96"])
print("SAMPLES", len(plan_split(cfg, "train").samples), flush=True)
"""


@pytest.mark.slow
def test_processes_started_together_tokenize_once(tmp_path, tiny_llama_dir):
    cfg = _config(tmp_path, tiny_llama_dir)
    env = dict(os.environ, PYTHONPATH=str(REPO), DEEPSPEC_NO_PROGRESS="1")
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(tiny_llama_dir), str(cfg.data_dir)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    from deepspec.data.cache.plan import plan_split

    assert {o for o, _ in outs} == {f"SAMPLES {len(plan_split(cfg, 'train').samples)}\n"}
    loaded = [e for _, e in outs if "loaded from" in e]
    assert len(loaded) == 2  # one process tokenized, the two others loaded its plan
