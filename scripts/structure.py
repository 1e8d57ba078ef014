"""The package's import structure, drawn from the code: every `import` (module level and inside functions) between
deepspec modules, the stage each module belongs to, the arrows that run back up the stage order, the import circles
(strongly connected groups of modules) and the imports of another module's private names.

    .venv/bin/python scripts/structure.py          # JSON: stages, back arrows, circles, private imports
    .venv/bin/python scripts/structure.py --dot    # a Graphviz drawing of the stage-level graph

tests/test_structure.py holds the package to its limits."""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "deepspec"

# The stage order, bottom to top: a module may import its own stage and any stage below it.
STAGES = ["ground", "config", "targets", "drafts", "data", "train", "export", "eval", "top"]
TOP = {"deepspec.cli", "deepspec.pipeline"}


def stage_of(module: str) -> str:
    parts = module.split(".")
    if module in TOP:
        return "top"
    if len(parts) >= 2 and parts[1] in STAGES:
        return parts[1]
    return "ground"  # deepspec/<file>.py: errors, log, locks, results, ...


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The deepspec module an imported dotted name lives in (the longest known prefix)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in known:
            return cand
    return None


def imports(known: dict[str, Path]) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """module -> the deepspec modules it imports; and (importer, imported module, name) for each private name taken."""
    edges: dict[str, set[str]] = defaultdict(set)
    private: list[tuple[str, str, str]] = []
    for mod, path in known.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _resolve(alias.name, known) if alias.name.startswith("deepspec") else None
                    if target and target != mod:
                        edges[mod].add(target)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                if not base.startswith("deepspec"):
                    continue
                for alias in node.names:
                    full = _resolve(f"{base}.{alias.name}", known)
                    target = full if full and full.endswith("." + alias.name) else _resolve(base, known)
                    if not target or target == mod:
                        continue
                    edges[mod].add(target)
                    is_module = full == f"{base}.{alias.name}"
                    if alias.name.startswith("_") and not alias.name.startswith("__") and not is_module:
                        private.append((mod, target, alias.name))
    return edges, private


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return sorted(out)


def report() -> dict:
    known = modules()
    edges, private = imports(known)
    rank = {s: i for i, s in enumerate(STAGES)}
    back = sorted((a, b) for a, bs in edges.items() for b in bs if rank[stage_of(b)] > rank[stage_of(a)])
    return {
        "modules": len(known),
        "stages": STAGES,
        "back_arrows": [f"{a} -> {b}" for a, b in back],
        "circles": circles(edges),
        "private_imports": [f"{a} imports {n} from {b}" for a, b, n in sorted(private)],
        "edges": {a: sorted(bs) for a, bs in sorted(edges.items())},
    }


def dot(rep: dict) -> str:
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for a, bs in rep["edges"].items():
        for b in bs:
            sa, sb = stage_of(a), stage_of(b)
            if sa != sb:
                counts[(sa, sb)] += 1
    rank = {s: i for i, s in enumerate(STAGES)}
    lines = ["digraph deepspec {", "  rankdir=BT;"]
    for (a, b), n in sorted(counts.items()):
        style = ' color=red penwidth=2' if rank[b] > rank[a] else ""
        lines.append(f'  "{a}" -> "{b}" [label={n}{style}];')
    return "\n".join(lines + ["}"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dot", action="store_true", help="print a Graphviz drawing of the stage graph instead")
    ap.add_argument("--edges", action="store_true", help="include every module's imports in the JSON")
    args = ap.parse_args()
    rep = report()
    if args.dot:
        print(dot(rep))
        return
    if not args.edges:
        rep.pop("edges")
    print(json.dumps(rep, indent=2))


if __name__ == "__main__":
    main()
