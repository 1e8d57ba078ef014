"""Logging conventions: `logging` with one readable console format, rank-aware.

Use ``log = get_logger(__name__)`` in every module; call :func:`setup_logging` once in
entry points. Only rank 0 logs at INFO in multi-worker runs (others log warnings), so a
2-worker run does not print every line twice.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname).1s [%(name)s] %(message)s"
_configured = False


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def setup_logging(level: int | str | None = None) -> None:
    """Configure the root 'deepspec' logger once (idempotent)."""
    global _configured
    if level is None:
        level = os.environ.get("DEEPSPEC_LOG_LEVEL", "INFO")
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
    if _rank() != 0 and level < logging.WARNING:
        level = logging.WARNING
    logger = logging.getLogger("deepspec")
    logger.setLevel(level)
    if not _configured:
        handler = logging.StreamHandler(sys.stderr)
        prefix = f"[rank{_rank()}] " if os.environ.get("WORLD_SIZE", "1") != "1" else ""
        handler.setFormatter(logging.Formatter(prefix + _FORMAT, datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
        _configured = True


def get_logger(name: str) -> logging.Logger:
    if not name.startswith("deepspec"):
        name = f"deepspec.{name}"
    return logging.getLogger(name)


def progress(iterable=None, **kwargs):
    """A tqdm progress bar that stays quiet on non-zero ranks and when DEEPSPEC_NO_PROGRESS=1."""
    from tqdm.auto import tqdm

    disable = _rank() != 0 or os.environ.get("DEEPSPEC_NO_PROGRESS") == "1"
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("mininterval", 1.0)
    return tqdm(iterable, disable=kwargs.pop("disable", disable), **kwargs)
