"""Small files written all-or-nothing: a temporary file beside the target, then a rename.

On the ground floor so that every stage can write its JSON documents this way (targets' recorded configs, data's
summaries and provenance) without importing a stage above it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """A small JSON document (summaries, provenance, recorded numbers) written all-or-nothing; concurrent writers of
    the same document each rename their own temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
