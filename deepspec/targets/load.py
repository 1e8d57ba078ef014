"""Loading a target: an embedded name, a Hugging Face model id, or a local folder."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepspec.errors import TargetError
from deepspec.log import get_logger
from deepspec.targets.embedded import embedded_target_dir, is_embedded

log = get_logger(__name__)


def resolve_target_path(name: str) -> str:
    """Embedded name -> converted folder; `tiny-mhc` -> its built folder; local folder -> absolute path;
    anything else is an HF id."""
    if is_embedded(name):
        return str(embedded_target_dir(name))
    if name == "tiny-mhc":
        from deepspec.targets.tiny_mhc import tiny_mhc_dir

        return str(tiny_mhc_dir())
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise TargetError(f"Target folder {p} has no config.json; point target.name at a Hugging Face model folder.")
        _register_local_model_type(p)
        return str(p.resolve())
    if name.startswith((".", "/", "~")):
        raise TargetError(f"Target path {name} does not exist; check target.name.")
    return name


def _register_local_model_type(folder: Path) -> None:
    """deepspec's own model types (tiny-mhc) register with transformers on import; do it before AutoConfig reads one."""
    import json

    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return
    if model_type == "deepspec_tiny_mhc":
        import deepspec.targets.tiny_mhc  # noqa: F401


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype_name(dtype: str, device: str | None = None) -> str:
    """The concrete dtype a `target.dtype` value means on `device` (default: this machine's).

    `auto`: bf16 on GPU, fp32 on CPU. `bf16_if_native`: bf16 on GPU and on CPUs that compute it in
    hardware (AVX512-BF16 / AMX), fp32 on other CPUs, where emulated bf16 is several times slower.
    """
    device = device or default_device()
    on_gpu = device.startswith("cuda")
    if dtype == "auto":
        return "bfloat16" if on_gpu else "float32"
    if dtype == "bf16_if_native":
        from deepspec.cpus import cpu_has_native_bf16

        return "bfloat16" if on_gpu or cpu_has_native_bf16() else "float32"
    return dtype


def resolve_dtype(dtype: str, device: str | None = None):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[resolve_dtype_name(dtype, device)]


def template_hash(tokenizer) -> str:
    """A short hash of the chat template: recorded by every stage so mismatches are caught."""
    return _hash_template(getattr(tokenizer, "chat_template", None))


def _hash_template(template: str | dict | None) -> str:
    template = template or ""
    if isinstance(template, dict):
        template = "".join(f"{k}:{v}" for k, v in sorted(template.items()))
    return hashlib.sha256(template.encode()).hexdigest()[:16]


def chat_template_hash(name: str, revision: str | None = None, trust_remote_code: bool = False) -> str:
    """`template_hash(load_tokenizer(name, ...))`, read from the tokenizer's files where they hold the template plainly.

    Why: a training rank or an export needs the hash alone (to check its cache or target against the chat template),
    and importing transformers' tokenizer classes pulls in every model class and generation (~1.7 s of a tiny run's
    4.3 s, in each rank). The files are read as the tokenizer's own loading reads them: chat_template.jinja, then
    additional_chat_templates/*.jinja, override tokenizer_config.json's `chat_template` (a list of named templates
    becomes a dict). Anything else (a hub id, a revision, remote code, a custom tokenizer class, no tokenizer_config.json)
    loads the tokenizer."""
    path = Path(resolve_target_path(name))
    template = _plain_chat_template(path) if path.is_dir() and not revision and not trust_remote_code else None
    if template is None:
        return template_hash(load_tokenizer(name, revision, trust_remote_code))
    return _hash_template(template[0])


def _plain_chat_template(folder: Path) -> tuple[str | dict | None] | None:
    """(the chat template the tokenizer in `folder` would have,), or None where only loading it can tell."""
    import json

    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or "auto_map" in config:
        return None
    files: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for f in extra.glob("*.jinja"):
            files[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if files:
        template = files["default"] if list(files) == ["default"] else files
    else:
        template = config.get("chat_template")
    if isinstance(template, (list, tuple)):
        template = {t["name"]: t["template"] for t in template}
    return (template,)


@dataclass
class Target:
    """A loaded target: HF model (eval mode, frozen) + tokenizer + identity for provenance."""

    name: str
    path: str
    revision: str | None
    model: Any
    tokenizer: Any

    @property
    def config(self):
        return self.model.config

    @property
    def template_hash(self) -> str:
        return template_hash(self.tokenizer)

    def provenance(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "target": self.name,
            "target_path": self.path,
            "target_revision": self.revision,
            "target_architecture": (cfg.architectures or [type(self.model).__name__])[0],
            "target_num_layers": cfg.num_hidden_layers,
            "target_hidden_size": cfg.hidden_size,
            "target_hc_mult": int(getattr(cfg, "hc_mult", None) or 1),
            "target_vocab_size": cfg.vocab_size,
            "template_hash": self.template_hash,
        }


def load_tokenizer(name: str, revision: str | None = None, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = resolve_target_path(name)
    try:
        return AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise TargetError(f"Could not load the tokenizer of target '{name}' ({e}); check target.name and your network/HF token.") from None


def load_target(
    name: str = "smollm2-135m-instruct",
    *,
    revision: str | None = None,
    dtype: str = "auto",
    device: str | None = None,
    attn_implementation: str = "auto",
    trust_remote_code: bool = False,
    device_map: str | dict[str, Any] | None = None,
) -> Target:
    """Load a frozen target model and its tokenizer.

    `device_map` (e.g. "auto") shards the weights over every visible GPU (and CPU RAM past them) through
    accelerate, for targets too large for one device; the model is then left where it was placed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from deepspec.targets.adapters import adapter_for

    device = device or default_device()
    path = resolve_target_path(name)
    try:
        adapter_for(AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code))
    except (OSError, ValueError) as e:
        raise TargetError(f"Could not read the config of target '{name}' ({e}); check target.name (HF id or local folder).") from None
    kwargs: dict[str, Any] = {"dtype": resolve_dtype(dtype, device), "revision": revision, "trust_remote_code": trust_remote_code}
    if attn_implementation != "auto":
        kwargs["attn_implementation"] = attn_implementation
    elif device.startswith("cuda"):
        kwargs["attn_implementation"] = "sdpa"
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as e:
        raise TargetError(f"Could not load target '{name}' ({e}); check target.name (HF id or local folder) and network access.") from None
    except ImportError as e:
        raise TargetError(f"Loading target '{name}' with target.device_map={device_map!r} needs accelerate ({e}); pip install accelerate.") from None
    if device_map is None:
        model.to(device)
    model.eval().requires_grad_(False)
    tokenizer = load_tokenizer(name, revision, trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    log.info("loaded target %s (%d layers, hidden %d) on %s", name, model.config.num_hidden_layers, model.config.hidden_size, device)
    return Target(name=name, path=path, revision=revision, model=model, tokenizer=tokenizer)


def load_target_from_config(tcfg, device: str | None = None) -> Target:
    """Load the target described by a `TargetConfig`."""
    return load_target(
        tcfg.name, revision=tcfg.revision, dtype=tcfg.dtype, device=device,
        attn_implementation=tcfg.attn_implementation, trust_remote_code=tcfg.trust_remote_code,
        device_map=getattr(tcfg, "device_map", None),
    )


