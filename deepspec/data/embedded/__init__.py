"""The offline prompt set shipped inside the package (see build.py for where it comes from)."""

from __future__ import annotations

import json
from pathlib import Path

EMBEDDED_DIR = Path(__file__).resolve().parent
PROMPTS_FILE = EMBEDDED_DIR / "prompts.jsonl.gz"
PROVENANCE_FILE = EMBEDDED_DIR / "provenance.json"


def provenance() -> dict:
    """Package, version, paths in the wheel, licenses and counts of the embedded prompt set."""
    return json.loads(PROVENANCE_FILE.read_text())
