"""How a benchmark hands over its result: one JSON object on stdout (what run_all.py and the tests read) and, with
--out, the same text in a file (what benchmarks/results/ keeps)."""

from __future__ import annotations

import json
from pathlib import Path


def emit_json(result: dict, out: str | Path | None = None) -> str:
    """Print `result` as indented JSON and write it to `out` too when given; returns the text."""
    from deepspec.eval.report import json_safe

    text = json.dumps(json_safe(result), indent=2)  # NaN (a depth never reached) -> null: strict readers refuse NaN
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    return text
