"""Conversations -> prompt token ids through the model's chat template (``LLM.chat``, the server).

A conversation is a list of ``{"role": ..., "content": ...}`` messages (system, user, assistant,
in any number of turns); the rendered template holds its own special tokens, so it is encoded
without adding BOS again.

Content is data: a special token typed in a message ("<|im_start|>system") is encoded as the
text it is, never as the control token, so the roles of the prompt are the ones the messages
say. To know which characters of the rendered text came from content, the template is rendered
a second time with a marker in place of each content (``_content_spans``); the template's own
text is encoded with special tokens parsed, the content without. Content with no special token
in it is encoded exactly as before, in one piece.
"""

from __future__ import annotations

import bisect
import re
import secrets
from collections.abc import Sequence

import jinja2

ROLES = ("system", "user", "assistant", "tool", "developer")


def check_messages(messages) -> list[dict]:
    """The messages as plain dicts; ValueError naming the first bad one."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] must be a dict with a role in {ROLES}")
        content = m.get("content")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")
        check_unicode(content, f"messages[{i}].content")
        checked.append({"role": m["role"], "content": content})
    return checked


def check_unicode(text: str, what: str) -> None:
    """ValueError naming ``what`` when text holds a lone surrogate (it has no UTF-8 form)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} is not valid Unicode: a lone surrogate at character {e.start}"
        ) from None


def is_conversation(messages) -> bool:
    """One conversation (a list of message dicts) rather than a list of conversations."""
    return isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], dict)


def render_chat(tokenizer, messages, add_generation_prompt: bool = True) -> str:
    """The conversation rendered with the model's template; a template that refuses it (its
    ``raise_exception``, a missing variable) is a ValueError."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template: {e}") from None


def chat_prompt_ids(
    tokenizer, messages, add_generation_prompt: bool = True, max_chars: int | None = None
) -> list[int]:
    """The prompt token ids of one conversation, ready for the assistant's turn. ``max_chars``:
    a rendered prompt longer than this is a ValueError before it is tokenized."""
    messages = check_messages(messages)
    text = render_chat(tokenizer, messages, add_generation_prompt)
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(
            f"the rendered conversation has {len(text)} characters, more than the "
            f"{max_chars} that max_model_len tokens can hold"
        )
    return encode_chat(tokenizer, messages, text, add_generation_prompt)


def encode_chat(tokenizer, messages: list[dict], text: str, add_generation_prompt: bool):
    """Token ids of ``text`` (the rendered ``messages``) where only the template's own special
    tokens are control tokens."""
    ids, offsets = tokenizer.encode_offsets(text)
    spans = _content_spans(tokenizer, messages, text, add_generation_prompt)
    if spans is None:  # the template reshapes content: see _from_skeleton
        if not any(_holds_special(tokenizer, m["content"]) for m in messages):
            return ids
        return _from_skeleton(tokenizer, messages, add_generation_prompt)
    if not _forged(tokenizer.special_token_ids, ids, offsets, spans):
        return ids
    return _encode_pieces(tokenizer, text, spans)


def _markers(messages: list[dict]) -> tuple[list[dict], re.Pattern]:
    """The messages with each content replaced by a marker no content holds, and the pattern
    that finds the markers (its group: the message index)."""
    nonce = secrets.token_hex(8)
    marked = [{**m, "content": f"\ue000{nonce}{i}\ue001"} for i, m in enumerate(messages)]
    return marked, re.compile(f"\ue000{nonce}(\\d+)\ue001")


def _skeleton(tokenizer, messages, add_generation_prompt) -> list[str | int]:
    """The template rendered around markers: [text, message index, text, index, ..., text]."""
    marked, pattern = _markers(messages)
    parts = pattern.split(render_chat(tokenizer, marked, add_generation_prompt))
    return [int(p) if i % 2 else p for i, p in enumerate(parts)]


def _content_spans(tokenizer, messages, text, add_generation_prompt) -> list[tuple] | None:
    """(start, end) of each content in ``text``, in order; None when the text is not the
    skeleton with each marker replaced by its content, as given or stripped (``| trim``)."""
    try:
        parts = _skeleton(tokenizer, messages, add_generation_prompt)
    except ValueError:  # the template refuses a marker where it took the content
        return None
    if not text.startswith(parts[0]):
        return None
    pos, spans = len(parts[0]), []
    for index, after in zip(parts[1::2], parts[2::2], strict=True):
        content = messages[index]["content"]
        for candidate in (content, content.strip()):
            end = pos + len(candidate)
            if text.startswith(candidate, pos) and text.startswith(after, end):
                break
        else:
            return None
        spans.append((pos, end))
        pos = end + len(after)
    return spans if pos == len(text) else None


def _forged(specials, ids: list[int], offsets: list[tuple], spans: list[tuple]) -> bool:
    """Whether a special token among ids (at offsets) overlaps a content span."""
    starts = [s for s, _ in spans]
    for token, (start, end) in zip(ids, offsets, strict=True):
        if token not in specials:
            continue
        k = bisect.bisect_right(starts, start) - 1  # the last span starting at or before it
        if k >= 0 and start < spans[k][1]:
            return True
        if k + 1 < len(spans) and spans[k + 1][0] < end:
            return True
    return False


def _encode_pieces(tokenizer, text: str, spans: list[tuple]) -> list[int]:
    """The template's text with special tokens parsed, each content span without."""
    ids, pos = [], 0
    for start, end in spans:
        ids += tokenizer.encode(text[pos:start], add_special_tokens=False)
        ids += _plain(tokenizer, text[start:end])
        pos = end
    return ids + tokenizer.encode(text[pos:], add_special_tokens=False)


def _plain(tokenizer, text: str) -> list[int]:
    """Token ids of content: special tokens in it are spelled out as text."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def _holds_special(tokenizer, content: str) -> bool:
    names = (tokenizer.id_to_token(i) for i in tokenizer.special_token_ids)
    return any(name and name in content for name in names)


def _from_skeleton(tokenizer, messages, add_generation_prompt) -> list[int]:
    """For a template that changes content (so no span of the real rendering is known): the
    template rendered around markers, each marker replaced by its content as plain text."""
    ids = []
    for i, part in enumerate(_skeleton(tokenizer, messages, add_generation_prompt)):
        if i % 2:
            ids += _plain(tokenizer, messages[part]["content"])
        else:
            ids += tokenizer.encode(part, add_special_tokens=False)
    return ids
