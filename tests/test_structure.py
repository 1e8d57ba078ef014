"""The package's import structure (scripts/structure.py, drawn from every import in deepspec/): stages import one way
(ground < config < targets < drafts < data < train < export < eval < top), no module takes another's private name,
and no modules import each other in a circle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "structure.py"


def _structure():
    return load_script(SCRIPT)


def test_stages_import_one_way_and_no_private_names_cross_modules():
    rep = _structure().report()
    assert rep["modules"] > 100
    assert rep["back_arrows"] == [], "an import runs back up the stage order: " + "; ".join(rep["back_arrows"])
    assert rep["private_imports"] == [], "; ".join(rep["private_imports"])
    assert rep["circles"] == [], "modules import each other in a circle: " + "; ".join(" <-> ".join(c) for c in rep["circles"])


def test_the_drawing_sees_what_it_should(tmp_path):
    """The analysis itself: a back arrow, a circle and a private import in a scratch package are each found."""
    mod = _structure()
    pkg = tmp_path / "deepspec"
    for rel, text in {
        "__init__.py": "",
        "errors.py": "from deepspec.train.loop import _step\n",          # ground -> train: back up, private
        "train/__init__.py": "",
        "train/loop.py": "def _step():\n    from deepspec.train import build\n",
        "train/build.py": "from deepspec.train.loop import _step as s\n",  # loop <-> build: a circle
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    mod.PKG, mod.ROOT = pkg, tmp_path
    rep = mod.report()
    assert rep["back_arrows"] == ["deepspec.errors -> deepspec.train.loop"]
    assert rep["circles"] == [["deepspec.train.build", "deepspec.train.loop"]]
    assert rep["private_imports"] == ["deepspec.errors imports _step from deepspec.train.loop",
                                      "deepspec.train.build imports _step from deepspec.train.loop"]


def test_the_script_prints_json_and_a_drawing():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True).stdout
    assert set(json.loads(out)) >= {"modules", "stages", "back_arrows", "circles", "private_imports"}
    dot = subprocess.run([sys.executable, str(SCRIPT), "--dot"], capture_output=True, text=True, check=True).stdout
    assert dot.startswith("digraph deepspec") and '"train" -> "data"' in dot
