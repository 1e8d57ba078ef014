"""`deepspec export --push-to-hub REPO_ID`: upload an export folder (weights, config.json, README.md model card and
any code the export ships)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepspec.errors import ConfigError, MissingDependencyError

# code an export ships for loaders outside deepspec (a DFlash export's auto_map names it: without it on the hub,
# transformers' trust_remote_code cannot load the draft)
SHIPPED_CODE = sorted(p.name for p in Path(__file__).with_name("hf_remote").glob("*.py") if p.name != "__init__.py")
# what an engine needs, the code it loads, the card and the recipe; nothing else from the folder is uploaded (not
# served_contract.json: it holds eval prompts, which may be private)
UPLOAD_PATTERNS = ["config.json", "model.safetensors", "README.md", "deepspec_config.yaml", *SHIPPED_CODE]


def upload_files(folder: str | Path) -> list[str]:
    """The files of `folder` push_to_hub uploads (sorted)."""
    folder = Path(folder)
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name in UPLOAD_PATTERNS)


def push_to_hub(folder: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None, api: Any = None) -> str:
    """Create `repo_id` (a model repository) if needed and upload the export in one commit. Returns the commit URL.

    `api`: a huggingface_hub.HfApi (or anything with create_repo / upload_folder); the default uses the token
    huggingface_hub finds (HF_TOKEN or a stored login)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise ConfigError(f"{folder} is not an export (config.json and model.safetensors expected); run `deepspec export` first.")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ConfigError(f"--push-to-hub {repo_id!r} is not a repository id; use OWNER/NAME.")
    if api is None:
        try:
            from huggingface_hub import HfApi
        except ImportError:
            raise MissingDependencyError("huggingface_hub", "Uploading an export", "pip install huggingface_hub") from None
        api = HfApi()
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    info = api.upload_folder(
        repo_id=repo_id, repo_type="model", folder_path=str(folder), revision=revision,
        allow_patterns=UPLOAD_PATTERNS, commit_message=f"Upload {folder.name} (deepspec export)",
    )
    return str(getattr(info, "commit_url", info))
