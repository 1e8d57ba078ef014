"""eval stage: speculative decoding of a draft on benchmarks (tau, per-depth acceptance, speedup, engine tau).

Modules: metrics (AcceptanceStats / TimingStats), sampling (exact rejection sampling), decode (target-only
and speculative loops), benchmarks + datasets_build (eval_datasets/), runner (`evaluate`), report
(results.json / .md / .png), engine (vLLM-backed), cli (`deepspec eval`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def evaluate(cfg, checkpoint_dir: str | Path, **kwargs: Any) -> dict[str, Any]:
    """Evaluate a draft checkpoint (see deepspec.eval.runner.evaluate); imported lazily to keep torch out of CLI start-up."""
    from deepspec.eval.runner import evaluate as _evaluate

    return _evaluate(cfg, checkpoint_dir, **kwargs)


__all__ = ["evaluate"]
