"""The model card (README.md) every export writes, and --push-to-hub's upload (folder and call arguments)."""

from __future__ import annotations

import json

import pytest
import torch

from deepspec.config.model import ModelConfig
from deepspec.drafts import get_algorithm
from deepspec.drafts.checkpoint import save_draft
from deepspec.errors import ConfigError
from deepspec.eval.metrics import AcceptanceStats
from deepspec.export.writers import export_draft
from deepspec.targets import tiny_config


def _ckpt(tmp_path, algorithm="eagle3", family="llama", opts=(), **fields):
    from deepspec.config import load_config

    fields.setdefault("target_layer_ids", [0, 2, 3])
    mcfg = ModelConfig(algorithm=algorithm, block_size=4, **fields)
    draft = get_algorithm(algorithm).from_target_config(tiny_config(family), mcfg)
    if algorithm == "eagle3":
        draft.set_token_frequencies(torch.arange(320).float())
    prov = {"target": f"tiny-{family}", "target_vocab_size": 320, "target_hidden_size": 64, "target_num_layers": 6,
            "template_hash": "abcd1234abcd1234", "data_hash": "feedbeef"}
    cfg = load_config(None, [f"model.algorithm={algorithm}", "train.lr=3e-4", "train.optimizer=muon", "train.epochs=2", *opts])
    return save_draft(draft, tmp_path / "step_10", prov, config=cfg)


def _results():
    """A results.json as deepspec eval writes it (from real acceptance counters)."""
    gsm, mt = AcceptanceStats(), AcceptanceStats()
    for a in (3, 1, 0, 2, 3, 3):
        gsm.add_round(3, a)
    for a in (0, 1, 0, 2):
        mt.add_round(3, a)
    overall = AcceptanceStats()
    overall.merge(gsm)
    overall.merge(mt)
    return {"overall": overall.summary(), "tasks": {"gsm8k": {**gsm.summary(), "samples": 2}, "mtbench": {**mt.summary(), "samples": 1}},
            "meta": {"temperature": 0.0, "num_draft_tokens": 3, "max_new_tokens": 64, "devices": ["cpu"]}}


def test_card_without_measurements_says_not_measured(tmp_path):
    ckpt = _ckpt(tmp_path, fc_norm=True, norm_output=True, target_layer_ids=[-1, 0, 2, 3])
    card = (export_draft(ckpt, tmp_path / "out", "vllm") / "README.md").read_text()
    assert card.startswith("---\n") and "# EAGLE-3.1 draft for tiny-llama" in card
    assert "| Taps (output of decoder layer k; -1 = embeddings) | [-1, 0, 2, 3] |" in card
    assert "`eagle_aux_hidden_state_layer_ids`, k + 1) | [0, 1, 3, 4] |" in card
    assert "Held-out acceptance: not measured" in card and "speedup: not measured" in card
    assert "muon lr 0.0003" in card
    assert "2.0 epochs" in card and "template hash abcd1234abcd1234" in card
    assert 'vllm serve tiny-llama --speculative-config \'{"method":"eagle3","model":"out","num_speculative_tokens":7}\'' in card
    assert "--speculative-algorithm EAGLE3 --speculative-draft-model-path out --speculative-num-steps 7" in card
    for bad in ("nan", "None x"):
        assert bad not in card


def test_card_reports_the_checkpoints_own_eval_and_served_figures(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "manifest.json").write_text(json.dumps({"counts": {"samples": 1234, "loss_tokens": 56789}}))
    ckpt = _ckpt(tmp_path, "dflash", opts=[f"cache.dir={tmp_path / 'cache'}"])
    res = _results()
    res["engine"] = {"num_speculative_tokens": 3, "machine": "2-core CPU", "overall": {"engine_tau": 2.25, "ours_tau_at_S": 2.3},
                     "tasks": {"gsm8k": {"engine_tau": 2.5, "ours_tau_at_S": 3.0}},
                     "speedup": {"gsm8k": {"single": {"baseline_tokens_per_s": 40.0, "speedup": 1.31}, "concurrent": {"speedup": 1.05}}}}
    (ckpt / "eval").mkdir()
    (ckpt / "eval" / "results.json").write_text(json.dumps(res))
    card = (export_draft(ckpt, tmp_path / "out", "vllm") / "README.md").read_text()
    gsm = res["tasks"]["gsm8k"]
    row = next(line for line in card.splitlines() if line.startswith("| gsm8k | 2 |"))
    assert f"| {gsm['acc0']:.3f} |" in row and f"| {gsm['E[A]@S3']:.3f} |" in row and f"| {gsm['tau@3']:.3f} |" in row
    assert row.count("| not measured |") == 2  # E[A]@S7 (3 drafts per round) and our loop's speedup were not measured
    assert "| gsm8k | 2.500 | 3.000 | not decided | 40.0 | 1.31x | 1.05x |" in card  # no per-depth verdict recorded
    assert "on 2-core CPU, greedy (T=0) on both sides" in card and "temperature 0.0 (greedy (T=0))" in card and "| Block size | 4 " in card
    assert "| Training samples / loss tokens (cache manifest) | 1234 / 56789 |" in card
    assert '"method":"dflash","model":"out","num_speculative_tokens":3' in card  # the training block
    assert "--speculative-algorithm DFLASH" in card and "--speculative-num-draft-tokens 4" in card
    # the upload carries the remote code its auto_map names (a downloaded DFlash draft loads with trust_remote_code),
    # and leaves out the served-acceptance contract (it holds the eval prompts)
    from deepspec.export.hub import upload_files

    out = tmp_path / "out"
    auto = json.loads((out / "config.json").read_text())["auto_map"]["AutoModel"]
    assert f"{auto.split('.')[0]}.py" in upload_files(out) and (out / "served_contract.json").is_file()
    assert upload_files(out) == sorted(p.name for p in out.iterdir() if p.is_file() and p.name != "served_contract.json")


def test_card_names_an_engine_that_cannot_serve_the_draft(tmp_path):
    ckpt = _ckpt(tmp_path, "eagle3", "qwen3")  # Qwen3-style draft layers: SGLang has no EAGLE-3 class with q/k norms
    card = (export_draft(ckpt, tmp_path / "out", "vllm") / "README.md").read_text()
    assert "SGLang: not served as trained" in card and "q/k RMSNorms" in card
    assert "vllm serve" in card


class _FakeApi:
    def __init__(self):
        self.calls = []

    def create_repo(self, **kw):
        self.calls.append(("create_repo", kw))

    def upload_folder(self, **kw):
        self.calls.append(("upload_folder", kw))
        return type("Info", (), {"commit_url": "https://example.invalid/commit/1"})()


def test_push_to_hub_uploads_the_export_folder(tmp_path):
    from deepspec.export.hub import push_to_hub, upload_files

    out = export_draft(_ckpt(tmp_path), tmp_path / "out", "vllm")
    (out / "notes.tmp").write_text("not part of the export")
    assert upload_files(out) == ["README.md", "config.json", "deepspec_config.yaml", "model.safetensors"]  # no contract: eval prompts
    api = _FakeApi()
    assert push_to_hub(out, "me/tiny-eagle3", private=True, api=api) == "https://example.invalid/commit/1"
    (name1, create), (name2, upload) = api.calls
    assert name1 == "create_repo" and create == {"repo_id": "me/tiny-eagle3", "repo_type": "model", "private": True, "exist_ok": True}
    assert name2 == "upload_folder" and upload["folder_path"] == str(out) and upload["repo_id"] == "me/tiny-eagle3"
    assert set(upload["allow_patterns"]) == {"README.md", "config.json", "deepspec_config.yaml", "model.safetensors",
                                             "modeling_deepspec_dflash.py"}
    with pytest.raises(ConfigError, match="OWNER/NAME"):
        push_to_hub(out, "no-owner", api=api)
    with pytest.raises(ConfigError, match="not an export"):
        push_to_hub(tmp_path, "me/x", api=api)
