"""Chat rendering and loss masks from token offsets.

A draft learns to predict what the *assistant* says, so the loss mask must mark exactly the
assistant-turn tokens of the rendered conversation. We render with the target's own chat
template (the same one regeneration and eval use), find the character span of each assistant
message's content in the rendered text — walking the messages in order, so a user turn that
quotes the assistant can never be mistaken for it — and map those character spans to tokens
with the fast tokenizer's ``return_offsets_mapping``. No regex over template markup is used, so
any template (ChatML, SmolLM2, Qwen3 with or without thinking) works unchanged.

Masked tokens (the choice, documented once):
  * every token whose character span overlaps the assistant content, and
  * the end-of-turn token right after the content (e.g. ``<|im_end|>``) when it is a special
    token: the draft must learn to predict the end of a turn, since the target emits it.
  * an assistant message that carries ``<think>reasoning</think>answer`` which the template
    re-renders in its own block (Qwen3 with thinking): from its ``<think>`` through the answer,
    the think markup included (the target generates it in thinking mode); earlier turns whose
    reasoning the template drops are masked on the answer only.
Template markup (role headers, the empty ``<think></think>`` block Qwen3 inserts with
``enable_thinking: false``, the newline after ``<|im_end|>``) is not masked.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from deepspec.errors import DataError


class RenderedChat(NamedTuple):
    input_ids: list[int]
    loss_mask: list[bool]
    truncated: bool


def render_text(tokenizer, messages: Sequence[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The conversation as the target sees it (no generation prompt: the last turn is complete)."""
    kwargs = dict(chat_template_kwargs or {})
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=False, **kwargs)
    except Exception as e:  # jinja errors: a template that rejects this conversation
        raise DataError(f"The target's chat template could not render a conversation ({e}); check the roles/contents.") from None


def render_prompt(tokenizer, messages: Sequence[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt's token ids with the generation prompt, as regeneration and the cache render it (same kwargs): what
    the evaluator and a served engine see before the answer."""
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {}))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _candidates(content: str) -> list[str]:
    """Texts a template may render for one assistant message, most faithful first.

    Templates differ in what they do to content: Qwen3 strips surrounding whitespace and moves a
    ``<think>...</think>`` prefix into its own block (dropping it for earlier turns)."""
    out = [content, content.strip()]
    if "</think>" in content:
        out.append(content.split("</think>")[-1].strip())
    return [c for i, c in enumerate(out) if c and c not in out[:i]]


def assistant_char_spans(text: str, messages: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """Character spans [start, end) of every assistant message's content in the rendered text."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise DataError(f"Message {i} has non-text content ({type(content).__name__}); only text conversations are supported.")
        found = None
        for cand in _candidates(content):
            pos = text.find(cand, cursor)
            if pos >= 0:
                found = (pos, pos + len(cand))
                break
        if found is None:
            if not content.strip():
                continue  # empty turn: nothing to learn, nothing to locate
            raise DataError(
                f"Could not find the content of message {i} ({m.get('role')}) in the rendered chat; the chat template "
                "rewrites it. Regenerate the data with this target's template."
            )
        if m.get("role") == "assistant" and "</think>" in content and found[1] - found[0] < len(content.strip()):
            # The template re-rendered the reasoning in its own block: the target generated it
            # too, so the span starts at the reasoning when it is rendered before the answer.
            reasoning = content.split("</think>")[0].split("<think>")[-1].strip()
            pos = text.find(reasoning, cursor, found[0]) if reasoning else -1
            if pos >= 0:
                think = text.rfind("<think>", cursor, pos)
                found = (think if think >= 0 else pos, found[1])
        if m.get("role") == "assistant":
            spans.append(found)
        cursor = found[1]
    return spans


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for tid, tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(tid))
    return ids


def mask_from_offsets(
    offsets: Sequence[tuple[int, int]], input_ids: Sequence[int], spans: Sequence[tuple[int, int]], end_of_turn_ids: set[int]
) -> list[bool]:
    """Mark tokens overlapping any span, plus the special token that directly follows each span."""
    mask = [False] * len(offsets)
    j = 0
    for start, end in spans:
        while j < len(offsets) and offsets[j][1] <= start:
            j += 1
        while j < len(offsets) and offsets[j][0] < end:
            if offsets[j][1] > offsets[j][0]:  # zero-width tokens carry no text
                mask[j] = True
            j += 1
        if j < len(offsets) and input_ids[j] in end_of_turn_ids and offsets[j][0] >= end:
            mask[j] = True
    return mask


def render_conversation(
    tokenizer,
    messages: Sequence[dict[str, Any]],
    chat_template_kwargs: dict[str, Any] | None = None,
    max_length: int | None = None,
) -> RenderedChat:
    """Tokenize a conversation with the target's template; return (input_ids, loss_mask, truncated)."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("Loss masks need a fast (Rust) tokenizer with offset mapping; the target's tokenizer is a slow one.")
    text = render_text(tokenizer, messages, chat_template_kwargs)
    spans = assistant_char_spans(text, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(enc["input_ids"])
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    mask = mask_from_offsets(offsets, input_ids, spans, _special_ids(tokenizer))
    truncated = max_length is not None and len(input_ids) > max_length
    if truncated:
        input_ids, mask = input_ids[:max_length], mask[:max_length]
    return RenderedChat(input_ids, mask, truncated)
