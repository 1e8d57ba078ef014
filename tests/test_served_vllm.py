"""`deepspec check EXPORT --served URL` against a real vLLM CPU server: an EAGLE-3.1 draft trained and evaluated by
`deepspec run` (the target's own greedy answers to six prompts, ~50 epochs: greedy tau ~3.6 at S = 3) is exported with
its served-acceptance contract; served as exported it matches the contract (exit 0), and the same export with every
aux layer id one too deep (vLLM captures other target layers) fails it (exit 1), naming the first position that drops.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from random_drafts import SERVED_PROMPTS, edit_export

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, DEEPSPEC_NO_PROGRESS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
PROMPTS = SERVED_PROMPTS
S, ANSWER_TOKENS, STEPS = 3, 64, 50


def _cli(*argv: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepspec.cli", *argv], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def export(tmp_path_factory, smollm2_dir) -> Path:
    """The trained, evaluated (T = 0, S drafts per round) and exported draft."""
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("served-contract")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    recipe = root / "eagle3.yaml"
    recipe.write_text(f"""_base_: {REPO / 'config/quickstart/eagle3.yaml'}
project: contract
exp: eagle3
target: {{dtype: float32}}   # one arithmetic on both sides
data:
  prompts: {{sources: [{{source: {root / 'prompts.jsonl'}}}], max_samples: {len(PROMPTS)}, heldout: 0}}
  regenerate: {{engine: hf, sampling: {{temperature: 0.0, max_tokens: {ANSWER_TOKENS}}}}}
cache: {{capture_backend: hf, max_length: 256}}
train: {{precision: fp32, epochs: 1000, max_steps: {STEPS}, save_every: {STEPS}, val_every: 0, global_batch_size: 6,
        micro_batch_size: 6, optimizer: adamw, lr: 3.0e-3}}
model: {{fc_norm: true, norm_output: true}}
eval:
  tasks: [{root / 'prompts.jsonl'}]
  task_max_samples: {{}}
  max_samples: {len(PROMPTS)}
  max_new_tokens: {ANSWER_TOKENS}
  num_draft_tokens: {S}
  measure_speedup: false
  num_workers: 1
""")
    run = _cli("run", str(recipe), "--stages", "prompts", "regenerate", "cache", "train", "eval",
               "--opts", f"output_root={root / 'outputs'}", f"train.output_root={root / 'checkpoints'}")
    assert run.returncode == 0, run.stderr[-4000:]
    ckpt = root / "checkpoints" / "contract" / "eagle3" / f"step_{STEPS}"
    out = _cli("export", str(ckpt), "--out", str(root / "export"), "--target", str(smollm2_dir), "--num-speculative-tokens", str(S))
    assert out.returncode == 0, out.stderr[-4000:]
    return root / "export"


def _served_check(export: Path, smollm2_dir: Path, log: Path, *extra: str) -> subprocess.CompletedProcess:
    from deepspec.data.engines.server import VLLMServer

    spec = {"method": "eagle3", "model": str(export), "num_speculative_tokens": S, "draft_sample_method": "greedy"}
    with VLLMServer(smollm2_dir, speculative_config=spec, dtype="float32", max_model_len=1024, log_path=log) as server:
        return _cli("check", str(export), "--served", server.url, *extra, timeout=900)


@pytest.mark.timeout(1800)
def test_served_draft_matches_its_contract_and_wrong_taps_fail_it(export, smollm2_dir, tmp_path):
    contract = json.loads((export / "served_contract.json").read_text())
    assert contract["measured"] and contract["aligned"] and contract["num_speculative_tokens"] == S
    assert contract["protocol"] == "greedy (T=0)" and contract["answer_budget"] == ANSWER_TOKENS
    assert len(contract["prompts"]) == len(PROMPTS)
    survival = contract["splits"]["prompts"]["survival"]
    assert survival[0] > 0.6 and survival[S - 1] > 0.3, survival  # real acceptance at every position
    assert "## Served-acceptance contract" in (export / "README.md").read_text()

    good = _served_check(export, smollm2_dir, tmp_path / "good.log")
    print(good.stdout)
    assert good.returncode == 0, good.stdout + good.stderr[-3000:]
    assert "The served draft matches its contract" in good.stdout and "z = 2.94" in good.stdout

    # the tap bug: every aux layer id one too deep, so vLLM feeds the draft other target layers than it was trained on
    def aux_plus_one(cfg):
        cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in cfg["eagle_aux_hidden_state_layer_ids"]]

    broken = edit_export(export, tmp_path / "aux-plus-one", aux_plus_one)
    bad = _served_check(broken, smollm2_dir, tmp_path / "bad.log", "--json")
    assert bad.returncode == 1, bad.stdout + bad.stderr[-3000:]
    report = json.loads(bad.stdout)
    print(report["verdict"])
    first = report["first_outside"]
    outside = [r["position"] for r in report["positions"] if not r["ok"]]
    assert first is not None and first["position"] == min(outside) and first["served"] < first["lo"]
    assert f"position {first['position']} first drops" in report["verdict"] and "does NOT match its contract" in report["verdict"]
