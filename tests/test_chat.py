"""Loss masks from token offsets: exactly the assistant content + its end-of-turn token.

Expected masks are hand-built by tokenizing the template's pieces one by one (role header,
content, <|im_end|>, newline) and marking the assistant pieces ourselves; the rendered
conversation must reproduce the same ids *and* the same mask.
"""

from __future__ import annotations

import pytest

from deepspec.data.chat import render_conversation
from deepspec.errors import DataError

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 is 4."},
    {"role": "user", "content": "Repeat exactly: ok then"},
    {"role": "assistant", "content": "ok then"},  # also appears in the user turn above
]


def expected_chatml(tokenizer, messages, default_system: str | None = None):
    """ChatML pieces tokenized separately; assistant content and its <|im_end|> are masked."""
    pieces: list[tuple[str, bool]] = []
    if default_system and messages[0]["role"] != "system":
        pieces += [("<|im_start|>", False), ("system\n" + default_system, False), ("<|im_end|>", False), ("\n", False)]
    for m in messages:
        is_a = m["role"] == "assistant"
        pieces += [("<|im_start|>", False), (m["role"] + "\n", False), (m["content"], is_a), ("<|im_end|>", is_a), ("\n", False)]
    ids: list[int] = []
    mask: list[bool] = []
    for text, on in pieces:
        t = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += t
        mask += [on] * len(t)
    return ids, mask


@pytest.fixture(scope="module")
def tiny_tok():
    from deepspec.targets import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="module")
def smol_tok(smollm2_dir):
    from deepspec.targets import load_tokenizer

    return load_tokenizer(str(smollm2_dir))


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
@pytest.mark.parametrize("with_system", [True, False])
def test_mask_is_exactly_assistant_tokens(which, with_system, request):
    tok = request.getfixturevalue("tiny_tok" if which == "tiny" else "smol_tok")
    messages = MULTI_TURN if with_system else MULTI_TURN[1:]
    ids, mask, truncated = render_conversation(tok, messages)
    exp_ids, exp_mask = expected_chatml(tok, messages, SMOL_SYSTEM if which == "smollm2" else None)
    assert ids == exp_ids
    assert mask == exp_mask
    assert not truncated
    # the masked text is the two assistant answers, each closed by <|im_end|>
    masked = tok.decode([t for t, m in zip(ids, mask) if m])
    assert masked == "2+2 is 4.<|im_end|>ok then<|im_end|>"


def test_truncation(tiny_tok):
    ids, mask, _ = render_conversation(tiny_tok, MULTI_TURN)
    t_ids, t_mask, truncated = render_conversation(tiny_tok, MULTI_TURN, max_length=40)
    assert truncated and t_ids == ids[:40] and t_mask == mask[:40]
    assert render_conversation(tiny_tok, MULTI_TURN, max_length=len(ids)).truncated is False


# A Qwen3-style template: an empty think block before the last answer when thinking is off,
# the reasoning re-rendered in its own block for the last turn, dropped for earlier turns.
QWEN3_STYLE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() %}"
    "{%- set content = content.split('</think>')[-1].strip() %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.last %}{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content.strip() + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture()
def qwen_tok():
    from deepspec.targets import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = QWEN3_STYLE
    return tok


def _masked_segments(tok, ids, mask):
    segs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            segs.append(tok.decode(cur))
            cur = []
    if cur:
        segs.append(tok.decode(cur))
    return segs


def test_qwen3_style_no_thinking(qwen_tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    ids, mask, _ = render_conversation(qwen_tok, messages, {"enable_thinking": False})
    text = qwen_tok.decode(ids)
    assert "<think>\n\n</think>" in text  # the empty think block is rendered ...
    assert _masked_segments(qwen_tok, ids, mask) == ["hello there<|im_end|>"]  # ... and not learned


def test_qwen3_style_thinking(qwen_tok):
    messages = [
        {"role": "user", "content": "a?"},
        {"role": "assistant", "content": "<think>first thoughts</think>\n\nanswer one"},
        {"role": "user", "content": "b?"},
        {"role": "assistant", "content": "<think>second thoughts</think>answer two"},  # re-spaced by the template
    ]
    ids, mask, _ = render_conversation(qwen_tok, messages, {"enable_thinking": True})
    assert "first thoughts" not in qwen_tok.decode(ids)  # dropped by the template for old turns
    assert _masked_segments(qwen_tok, ids, mask) == [
        "answer one<|im_end|>",
        "<think>\nsecond thoughts\n</think>\n\nanswer two<|im_end|>",
    ]


def test_unrenderable_content_is_a_data_error(tiny_tok):
    tok = tiny_tok
    old = tok.chat_template
    try:
        tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
        with pytest.raises(DataError, match="chat template"):
            render_conversation(tok, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "lower case"}])
    finally:
        tok.chat_template = old
