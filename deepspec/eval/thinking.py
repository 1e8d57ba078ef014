"""Thinking mode: acceptance with a chat template's thinking switch on and off, side by side.

Templates such as Qwen3's take `enable_thinking` (in `target.chat_template_kwargs`); the same prompt then renders
differently (an empty `<think></think>` block, or none) and the target answers in another register, so a draft is
accepted differently in each mode. `eval.thinking_modes` decodes the held-out splits once per listed mode. Whether the
template reacts at all is probed by rendering one conversation both ways: a template without a switch renders the same
text, and one mode is reported (the run as configured) instead of decoding the same prompts twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepspec.data.chat import render_prompt
from deepspec.eval.metrics import AcceptanceStats
from deepspec.log import get_logger

log = get_logger(__name__)

PROBE = [{"role": "user", "content": "What is 2 + 2?"}]
SWITCH = "enable_thinking"
NO_SWITCH_NOTE = "the chat template renders the same prompt with enable_thinking on and off: one mode reported (the run as configured)"


def mode_name(on: bool) -> str:
    return "on" if on else "off"


def mode_kwargs(base: dict[str, Any] | None, on: bool) -> dict[str, Any]:
    """The chat-template kwargs of a mode: the configured ones with the switch set."""
    return {**dict(base or {}), SWITCH: bool(on)}


def template_has_switch(tokenizer, base: dict[str, Any] | None = None) -> bool:
    """Whether the tokenizer's chat template renders a probe conversation differently with thinking on and off."""
    return render_prompt(tokenizer, PROBE, mode_kwargs(base, True)) != render_prompt(tokenizer, PROBE, mode_kwargs(base, False))


@dataclass
class ThinkingPlan:
    """What `eval.thinking_modes` decodes: per mode its kwargs, and whether the main run already is that mode."""

    switch: bool
    tasks: list[str]
    kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)  # mode name -> chat_template_kwargs
    reuse_main: dict[str, bool] = field(default_factory=dict)  # mode name -> the main run decoded exactly these prompts

    def to_decode(self) -> dict[str, dict[str, Any]]:
        """Modes that need their own decoding pass (mode name -> kwargs)."""
        return {m: kw for m, kw in self.kwargs.items() if not self.reuse_main[m]}


def plan(tokenizer, base: dict[str, Any] | None, modes: list[bool], tasks: list[str], target: str = "the target") -> ThinkingPlan:
    """Probe the template and decide which modes decode again (a mode whose kwargs equal the configured ones reuses
    the main run: same kwargs, same prompts, same seeds)."""
    base = dict(base or {})
    if not template_has_switch(tokenizer, base):
        log.info("eval.thinking_modes: %s's %s", target, NO_SWITCH_NOTE)
        return ThinkingPlan(False, tasks, {"off": base}, {"off": True})
    out = ThinkingPlan(True, tasks)
    for on in modes:
        kw = mode_kwargs(base, on)
        out.kwargs[mode_name(on)] = kw
        out.reuse_main[mode_name(on)] = kw == base
    log.info("eval.thinking_modes: %s's chat template has a thinking switch; %s decoded with thinking %s", target,
             ", ".join(tasks), " and ".join(out.kwargs))
    return out


def report(p: ThinkingPlan, mode_stats: dict[str, dict[str, AcceptanceStats]], main_stats: dict[str, AcceptanceStats],
           info: dict[str, dict]) -> dict[str, Any]:
    """The results.json block: per mode its kwargs, each split's figures and every split pooled."""
    modes: dict[str, Any] = {}
    for mode, kw in p.kwargs.items():
        source = main_stats if p.reuse_main[mode] else mode_stats.get(mode, {})
        tasks: dict[str, Any] = {}
        pooled = AcceptanceStats()
        for task in p.tasks:
            if task in source:
                tasks[task] = {"samples": info.get(task, {}).get("samples"), **source[task].summary()}
                pooled.merge(source[task])
        modes[mode] = {"chat_template_kwargs": kw, "reused_main_run": p.reuse_main[mode], "tasks": tasks,
                       "overall": pooled.summary()}
    out: dict[str, Any] = {"template_switch": p.switch, "tasks": list(p.tasks), "modes": modes}
    if not p.switch:
        out["note"] = NO_SWITCH_NOTE
    return out
