"""Autocast state asked per device, answered for devices that have none.

The meta device has no autocast state: `torch.is_autocast_enabled("meta")` and `torch.autocast("meta")` raise. A
training step runs on the meta device in the test that proves it reads no device value back
(tests/test_step_plan.py), so the drafts ask through these two helpers.
"""

from __future__ import annotations

import contextlib

import torch

# device types with an autocast state
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla")


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts to on `device_type`, None where it is off (or the device has no autocast)."""
    if device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def no_autocast(device_type: str):
    """A context with autocast off on `device_type` (nothing to turn off on a device without autocast)."""
    if device_type in _AUTOCAST_DEVICES:
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
