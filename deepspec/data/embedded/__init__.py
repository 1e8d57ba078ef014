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

# Further offline sets built by build_extra.py: name -> prompts file, one provenance file for all.
EXTRA_SETS = ("bfcl", "codeio")
EXTRA_PROVENANCE_FILE = EMBEDDED_DIR / "extra_provenance.json"


def extra_file(name: str) -> Path:
    return EMBEDDED_DIR / f"{name}.jsonl.gz"


def extra_provenance(name: str) -> dict:
    """Package, version, wheel hash, licenses and counts of one extra offline set."""
    return json.loads(EXTRA_PROVENANCE_FILE.read_text())[name]
