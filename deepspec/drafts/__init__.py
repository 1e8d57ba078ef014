"""Draft algorithms behind one interface (base.py) and a registry (registry.py)."""

from deepspec.drafts.base import DraftBatch, DraftModel, Proposer
from deepspec.drafts.registry import REGISTRY, available_algorithms, get_algorithm, register

__all__ = ["DraftBatch", "DraftModel", "Proposer", "REGISTRY", "available_algorithms", "get_algorithm", "register"]
