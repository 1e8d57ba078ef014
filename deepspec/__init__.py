"""deepspec: train, evaluate and export draft models for speculative decoding.

Importing the package is cheap and never needs a GPU-only dependency: stages import
torch, transformers and vLLM lazily, where they are used.
"""

__version__ = "0.1.0"

from deepspec.errors import DeepSpecError  # noqa: E402,F401
