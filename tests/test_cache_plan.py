"""The tokenized plan is made once per input and shared through the data folder: a second process (trainer rank,
producer, resumed run) loads exactly what the first tokenized, two processes started together tokenize once, and a
changed data file or rendering setting is a new plan, never a stale one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest


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


def _child(target: str, data_dir: str, queue) -> None:
    """One process's plan of the train split: (its sample count, the plan messages it logged)."""
    import logging

    from deepspec.config import load_config
    from deepspec.data.cache.plan import plan_split

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("deepspec")
    logger.addHandler(handler)
    logger.setLevel("INFO")
    cfg = load_config(None, [f"target.name={target}", f"data.dir={data_dir}", "cache.max_length=96"])
    queue.put((len(plan_split(cfg, "train").samples), messages))


@pytest.mark.slow
def test_processes_started_together_tokenize_once(tmp_path, tiny_llama_dir):
    """Three processes (forked from this one, which has imported what they need: new interpreters spent ~4 s each
    importing it) make the train split's plan at once: one tokenizes, the two others wait for it and load it."""
    import multiprocessing

    from deepspec.data.cache.plan import load_plan_inputs, plan_split

    cfg = _config(tmp_path, tiny_llama_dir)
    load_plan_inputs(cfg)  # the tokenizer's imports made here once, before the fork (no plan is made)
    assert not (cfg.data_dir / ".plans").exists()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(str(tiny_llama_dir), str(cfg.data_dir), queue)) for _ in range(3)]
    for p in procs:
        p.start()
    outs = [queue.get(timeout=120) for _ in procs]  # a child that failed puts nothing: this times out
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert {n for n, _ in outs} == {len(plan_split(cfg, "train").samples)}
    loaded = [m for _, m in outs if any("loaded from" in x for x in m)]
    assert len(loaded) == 2  # one process tokenized, the two others loaded its plan
