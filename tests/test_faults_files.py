"""Hostile and broken files: a checkpoint that would run code when unpickled, malformed JSONL lines, secrets in
configs. Each answer is one sentence naming the file (and line), and nothing we read executes code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]


class _Payload:
    """Unpickling this would create a file: what a malicious trainer_state.pt could do with weights_only=False."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_that_would_run_code_is_refused_not_executed(tmp_path):
    from safetensors.torch import save_file

    from deepspec.train.checkpoint import latest_step_dir, load_optimizer, load_trainer_state
    from deepspec.errors import CheckpointError

    run = tmp_path / "run"
    for step in (2, 4):
        d = run / f"step_{step}"
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))
        torch.save({"step": step, "scheduler": {}, "rng": []}, d / "trainer_state.pt")
        torch.save({"state": {}, "param_groups": []}, d / "optimizer.pt")
    marker = tmp_path / "pwned"
    torch.save({"step": 4, "evil": _Payload(str(marker))}, run / "step_4" / "trainer_state.pt")
    assert latest_step_dir(run) == run / "step_2"  # step_4 is skipped as damaged: its state needs code to load
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        load_trainer_state(run / "step_4")
    torch.save({"state": {}, "param_groups": [], "x": _Payload(str(marker))}, run / "step_2" / "optimizer.pt")
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        load_optimizer(run / "step_2", torch.nn.Linear(1, 1), torch.optim.AdamW(torch.nn.Linear(1, 1).parameters()), False)
    assert not marker.exists()
    assert CheckpointError  # imported: resume errors are CheckpointErrors


def test_malformed_jsonl_lines_are_one_sentence_with_file_and_line(tmp_path, tiny_llama_dir):
    from deepspec.config import load_config
    from deepspec.data.cache.plan import plan_split
    from deepspec.data.jsonl import write_jsonl_atomic
    from deepspec.data.regenerate import load_jobs, regenerate
    from deepspec.errors import DataError
    from deepspec.eval.benchmarks import load_custom_task

    cfg = load_config(None, [f"target.name={tiny_llama_dir}", f"data.dir={tmp_path / 'data'}", "data.regenerate.heldout=false",
                             "data.regenerate.engine=hf", "data.regenerate.sampling.max_tokens=2"])
    good = {"id": "a", "conversations": [{"role": "user", "content": "hi"}]}
    write_jsonl_atomic(cfg.conversations_path, [good, {**good, "id": "b"}])
    # prompts: the regenerate stage's input
    cfg.conversations_path.write_text(json.dumps(good) + "\n" + '{"id": "b", "conversations": [\n' + json.dumps({**good, "id": "c"}) + "\n")
    with pytest.raises(DataError, match=r"conversations.jsonl:2: not a conversation record"):
        load_jobs(cfg.conversations_path)
    write_jsonl_atomic(cfg.conversations_path, [good, {**good, "id": "b"}, {**good, "id": "c"}])
    # regenerated: a damaged line in the middle of an output being resumed (a torn last line is repaired instead)
    regenerate(cfg)
    lines = cfg.regenerated_path.read_text().splitlines()
    cfg.regenerated_path.write_text("\n".join([lines[0], lines[1][:25], lines[2]]) + "\n")
    with pytest.raises(DataError, match=r"regenerated.jsonl:2 is not valid JSON \(.* at column \d+\)"):
        regenerate(cfg)
    # the cache stage reading regenerated.jsonl
    with pytest.raises(DataError, match=r"regenerated.jsonl:2 is not a conversation record"):
        plan_split(cfg, "train")
    # a custom eval task
    task = tmp_path / "mine.jsonl"
    task.write_text('{"turns": ["hello"]}\n{"turns": ["x"\n')
    with pytest.raises(DataError, match=r"mine.jsonl:2: invalid JSON"):
        load_custom_task(task)


def test_saved_configs_never_hold_api_keys_tokens_or_url_passwords(tmp_path):
    from deepspec.config import load_config, save_config

    cfg = load_config(None, ["data.regenerate.urls=['http://me:hunter2@10.0.0.1:8000', 'http://h:1/v1?api_key=sk-abc']",
                             "eval.engine_extra_args=[--api-key, sk-SECRET42, --port, '9000']",
                             "data.regenerate.vllm_kwargs={hf_token: hf_XYZ, max_num_seqs: 8}", "eval.engine_url=http://u:pw1@h:1"])
    text = save_config(cfg, tmp_path).read_text()
    for secret in ("hunter2", "sk-abc", "sk-SECRET42", "hf_XYZ", "pw1"):
        assert secret not in text, secret
    data = yaml.safe_load(text)
    assert data["data"]["regenerate"]["urls"][0] == "http://me:<redacted>@10.0.0.1:8000"
    assert data["eval"]["engine_extra_args"] == ["--api-key", "<redacted>", "--port", "9000"]
    assert data["data"]["regenerate"]["vllm_kwargs"] == {"hf_token": "<redacted>", "max_num_seqs": 8}
    assert cfg.data.regenerate.urls[0] == "http://me:hunter2@10.0.0.1:8000"  # the live config keeps what it needs


def test_a_cut_or_garbled_draft_checkpoint_at_export_and_eval_is_one_sentence_naming_a_good_step(tmp_path):
    from random_drafts import random_draft_checkpoint

    from deepspec.drafts.checkpoint import load_draft
    from deepspec.errors import CheckpointError
    from deepspec.export.writers import export_draft

    run = tmp_path / "run"
    _, good = random_draft_checkpoint(run / "step_2", "llama", "eagle3")
    _, bad = random_draft_checkpoint(run / "step_4", "llama", "eagle3")
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    for load in (lambda: load_draft(bad), lambda: export_draft(bad, tmp_path / "out", fmt="vllm")):
        with pytest.raises(CheckpointError) as err:
            load()
        message = str(err.value)
        assert message.startswith(f"{weights} is damaged (") and "\n" not in message and str(good) in message
    assert not (tmp_path / "out").exists()  # no export from a damaged checkpoint
    (bad / "config.json").write_text('{"deepspec": {"algorithm": "eag')  # a config cut mid-write by another tool
    with pytest.raises(CheckpointError, match=r"config.json is damaged \(JSONDecodeError: .*\); the checkpoint cannot be read"):
        load_draft(bad)
    assert load_draft(good) is not None  # the other step still loads
