"""The per-split table of the headline names (acc0, acc_cond@k, E[A]@S3, E[A]@S7, tau@3) in results.md and
in the pipeline summary."""

from __future__ import annotations

import pytest

from deepspec.config import load_config
from deepspec.eval.metrics import AcceptanceStats
from deepspec.eval.report import markdown
from deepspec.pipeline import RecipeResult, summary_markdown


def _task(pattern, samples):
    s = AcceptanceStats()
    for proposed, accepted in pattern:
        s.add_round(proposed, accepted)
    return {"samples": samples, **s.summary()}


@pytest.fixture
def results():
    tasks = {"heldout:general": _task([(7, 7), (7, 1), (7, 0)], 3), "heldout:agentic": _task([(7, 2), (7, 3)], 2),
             "mbpp": {"skipped": "no file"}}
    return {"tasks": tasks, "overall": _task([(7, 7), (7, 1), (7, 0), (7, 2), (7, 3)], 5),
            "meta": {"algorithm": "eagle3", "max_new_tokens": 160}}


def test_results_md_has_one_row_per_split(results):
    lines = markdown(results).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("| split |"))
    head = lines[at]
    assert head.split(" | ")[3:] == ["acc0", "acc_cond@2", "acc_cond@3", "acc_cond@4", "acc_cond@5", "acc_cond@6",
                                     "acc_cond@7", "E[A]@S3", "E[A]@S7", "tau@3", "tau |"]
    row = next(line for line in lines[at:] if line.startswith("| heldout:general |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:4] == ["3", "160", "0.667"]  # samples, answer budget, acc0 = 2/3
    assert cells[-4] == "1.333" and cells[-3] == "2.667" and cells[-2] == "2.333"  # E[A]@S3, E[A]@S7, tau@3 (= 1 + 4/3)


def test_pipeline_summary_table(results):
    cfg = load_config(None, ["eval.max_new_tokens=160"])
    md = summary_markdown([RecipeResult("r.yaml", cfg, results=results)])
    assert "## per split (answers up to 160 tokens)" in md
    assert "| eagle3 / heldout:agentic | 2 | 160 | 1.000 |" in md


def test_pipeline_summary_names_the_served_as_trained_verdict(results):
    """The run summary's served-by-vLLM table ends with the per-depth verdict of the pooled comparison."""
    verdict = {"decided": True, "ok": False, "worst_depth": 2, "worst_relative_diff": -0.31, "tolerance": 0.05}
    cell = {"engine_tau": 1.5, "ours_tau_at_S": 2.0, "served_as_trained": verdict}
    results["engine"] = {"num_speculative_tokens": 3, "protocol": "greedy (T=0)", "tasks": {"heldout:general": cell},
                         "overall": cell}
    cfg = load_config(None, ["eval.max_new_tokens=160"])
    md = summary_markdown([RecipeResult("r.yaml", cfg, results=results)])
    head = next(line for line in md.splitlines() if line.startswith("| algorithm | protocol |") and "served as trained" in line)
    row = md.splitlines()[md.splitlines().index(head) + 2]
    assert row.endswith("| **NO** (depth 2: -31.0%, tolerance 5%) |"), row
