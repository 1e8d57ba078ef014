"""Leaving a process whose work is done without the interpreter's last garbage collection.

Why: as it exits, CPython runs a full collection over every object still alive. In a process that imported torch,
transformers or vLLM and ran a model, that walk costs 0.4-0.7 s of one core and frees nothing anyone will use (a
tiny `deepspec train` measured 3.0 -> 2.4 s to the shell prompt, before the exception below). `gc.freeze()` moves
those objects out of the collector's reach first. Everything else about exiting is unchanged: atexit handlers run
(logging, wandb, tensorboard, temporary folders), objects are released by reference counting as before, and non-daemon
threads are waited for; only an object kept alive by a reference cycle is not finalised (deepspec closes what it
writes explicitly).

Not where a nanobind extension is loaded (Triton's, which transformers' model classes, torch's compiler stack - a
training rank at its first optimizer step - and vLLM import): nanobind counts its objects still alive when the
interpreter ends and prints each one frozen here as a "leak", dozens of lines a user would take for a fault. Such a
process exits as usual; the ones that gain are those that load no model (the launcher, the prompts stage, ...).

Only for entry points (`python -m deepspec...`, the `deepspec` command): a process that goes on (a test, a notebook
calling `deepspec.cli.main`) must not freeze its heap.
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


# extensions built with nanobind that report frozen objects as leaks at the interpreter's end
_NANOBIND_MODULES = ("triton",)


def freeze_heap_for_exit() -> bool:
    """Move every object out of the final collection's reach, unless a nanobind extension is loaded; True if frozen.
    For a process that is about to end (exit_process, the test suite's processes)."""
    if any(name in sys.modules for name in _NANOBIND_MODULES):
        return False
    gc.freeze()
    return True


def exit_process(code: int | None) -> NoReturn:
    """sys.exit(code), the interpreter's final collection skipped where it can be (`freeze_heap_for_exit`)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away (`deepspec ... | head`), a closed stream
            pass
    freeze_heap_for_exit()
    sys.exit(code)
