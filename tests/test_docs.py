"""The README and the manual stay true: the site builds strictly, marked commands run, named config keys exist.

Conventions (docs/contributing-docs.md): a fenced ``bash`` block directly preceded by ``<!-- test: run -->`` is
executed here; every ``section.key`` written in code of a page must be a field of the schema.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from deepspec.config.schema import Config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_BYTES = 12_000
RUN_MARKER = "<!-- test: run -->"
BLOCK_TIMEOUT_S = 60


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ----------------------------------------------------------------------------- fenced blocks


@dataclasses.dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    info: str
    code: str
    runnable: bool


FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")


def fenced_blocks(path: Path) -> list[Block]:
    """Fenced code blocks of a Markdown file, each marked runnable when the marker comment precedes it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group(1), m.group(2), m.group(3).strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence) and lines[i].strip().strip(fence[0]) == ""):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # closing fence
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        runnable = prev >= 0 and lines[prev].strip() == RUN_MARKER
        blocks.append(Block(path, start + 1, info, "\n".join(body) + "\n", runnable))
    return blocks


def runnable_blocks() -> list[Block]:
    return [b for p in markdown_files() for b in fenced_blocks(p) if b.runnable]


def test_marker_only_on_bash_blocks():
    """A marker on anything but a bash fence would silently run nothing."""
    for path in markdown_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        marked = {n for n, line in enumerate(lines) if line.strip() == RUN_MARKER}
        found = {b.line for b in fenced_blocks(path) if b.runnable}
        for n in marked:
            nxt = n + 1
            while nxt < len(lines) and not lines[nxt].strip():
                nxt += 1
            assert nxt + 1 in found, f"{rel(path)}:{n + 1}: '{RUN_MARKER}' is not followed by a fenced block"
    for block in runnable_blocks():
        assert block.info.split()[0:1] == ["bash"], f"{rel(block.path)}:{block.line}: only ```bash blocks can be marked runnable"


def test_some_blocks_are_marked():
    names = {rel(b.path) for b in runnable_blocks()}
    assert "docs/configuration.md" in names and len(runnable_blocks()) >= 5, names


@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda b: f"{rel(b.path)}:{b.line}")
def test_runnable_block(block: Block):
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline", DEEPSPEC_NO_PROGRESS="1")
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert proc.returncode == 0, (
        f"{rel(block.path)}:{block.line} failed with status {proc.returncode}\n--- block\n{block.code}"
        f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    )


# ----------------------------------------------------------------------------- config keys

SECTIONS = tuple(name for name, tp in typing.get_type_hints(Config).items() if dataclasses.is_dataclass(tp))
# Keys the docs name on purpose because they do not exist (the unknown-key error example).
DELIBERATELY_UNKNOWN = {"train.lrr"}
# `section.key[.key...]`, not preceded by a name or path character (so deepspec.train.train and scripts/eval/eval.sh are not keys)
KEY = re.compile(r"(?<![\w./$-])(" + "|".join(SECTIONS) + r")((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
FILE_SUFFIXES = {"json", "jsonl", "yaml", "yml", "safetensors", "py", "sh", "md", "png", "pt", "txt", "bin", "npy", "gz", "html"}
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)


def code_text(path: Path) -> str:
    """Inline code spans and fenced blocks: where a page names a key (prose is not checked)."""
    parts = [b.code for b in fenced_blocks(path)]
    prose, fence = [], ""
    for line in path.read_text(encoding="utf-8").splitlines():
        m = FENCE.match(line)
        if m and (not fence or m.group(2).startswith(fence)):
            fence = "" if fence else m.group(2)
        elif not fence:
            prose.append(line)
    parts += [m.group(2) for m in INLINE_CODE.finditer("\n".join(prose))]
    return "\n".join(parts)


def named_keys(path: Path) -> set[str]:
    keys = set()
    for m in KEY.finditer(code_text(path)):
        name = m.group(1) + m.group(2)
        if name.rsplit(".", 1)[-1] in FILE_SUFFIXES:
            continue  # a file name such as model.safetensors
        keys.add(name)
    return keys


def key_exists(name: str) -> bool:
    """Walk the dataclasses; a dict-typed field accepts any sub-key (e.g. target.chat_template_kwargs.enable_thinking).
    A renamed key's old name (deepspec/config/loader.py RENAMED) is still read, so it counts."""
    from deepspec.config.loader import RENAMED

    name = RENAMED.get(name, name)
    cls: typing.Any = Config
    parts = name.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            return False
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        tp = hints[part]
        origin = typing.get_origin(tp)
        if tp is dict or origin is dict:
            return True
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if origin is typing.Union and len(args) == 1:
            tp = args[0]
        if i < len(parts) - 1 and not dataclasses.is_dataclass(tp):
            return False
        cls = tp
    return True


def test_key_checker_catches_typos():
    assert key_exists("train.global_batch_size") and key_exists("model.fc_norm")
    assert key_exists("data.regenerate.sampling.temperature") and key_exists("target.chat_template_kwargs.enable_thinking")
    assert key_exists("data.prompts")
    assert not key_exists("train.lrr") and not key_exists("model.fc_norm.x") and not key_exists("data.regenerate.sampling.nope")


def test_key_extraction():
    sample = DOCS / "configuration.md"
    keys = named_keys(sample)
    assert {"train.lr", "model.target_layer_ids", "data.regenerate.sampling.temperature"} <= keys, keys
    assert "model.safetensors" not in named_keys(DOCS / "export.md")


@pytest.mark.parametrize("path", markdown_files(), ids=rel)
def test_named_config_keys_exist(path: Path):
    missing = sorted(k for k in named_keys(path) if not key_exists(k) and k not in DELIBERATELY_UNKNOWN)
    assert not missing, f"{rel(path)} names config keys the schema (deepspec/config/) does not have: {missing}"


# ----------------------------------------------------------------------------- site, size, wording


def test_readme_size():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; keep it under {README_MAX_BYTES} and move detail into docs/"


def nav_pages(nav: typing.Any) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(nav_pages(x) for x in nav)) if nav else set()
    if isinstance(nav, dict):
        return set().union(*(nav_pages(v) for v in nav.values()))
    return set()


def test_every_page_in_nav():
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = nav_pages(cfg["nav"])
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages - listed == set(), f"docs pages missing from the nav in mkdocs.yml: {sorted(pages - listed)}"
    assert listed - pages == set(), f"nav entries without a page: {sorted(listed - pages)}"


def test_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


DEV_WORDS = re.compile(r"\bthe issue\b|\bissue's\b|\bthis session\b|\bthe session\b|\blead engineer\b", re.I)


def test_text_speaks_of_the_project():
    for path in markdown_files():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            assert not DEV_WORDS.search(line), f"{rel(path)}:{n}: {line.strip()[:120]}"


def test_mkdocs_build_strict(tmp_path: Path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "evaluation" / "index.html").is_file()


def test_every_test_the_docs_name_exists():
    """A doc row that names its proof (docs/reliability.md's, the training and data pages') names a test that exists:
    `test_x` a test function or module, `test_x...` a prefix of one; a test renamed or folded into another must take
    its rows with it."""
    tests_dir = ROOT / "tests"
    modules = {f.stem for f in tests_dir.glob("test_*.py")}
    functions = {name for f in tests_dir.glob("test_*.py") for name in re.findall(r"^(?:async )?def (test_\w+)", f.read_text(), re.M)}
    missing = []
    for path in markdown_files():
        for m in re.finditer(r"(test_\w+?)(\.\.\.|…)?(?=[\]\[`\s,;)|:.]|$)", path.read_text()):
            name, prefix = m.group(1), m.group(2)
            if name in modules or (any(f.startswith(name) for f in functions) if prefix else name in functions):
                continue
            missing.append(f"{rel(path)}: {name}{prefix or ''}")
    assert not missing, f"docs name tests that do not exist: {missing}"
