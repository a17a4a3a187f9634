"""Conversations -> prompt token ids through the model's chat template (``LLM.chat``, the server).

A conversation is a list of ``{"role": ..., "content": ...}`` messages (system, user, assistant,
tool, in any number of turns); an assistant turn may carry ``tool_calls`` and a tool turn its
``tool_call_id`` (and a message its ``name``); ``tools`` (function definitions) go to the template
too. A template that never reads ``tools`` (or ``tool_calls``) gets them written as text instead
(``tools_as_text``): the functions in the system message, each call as a ``<tool_call>`` block in
its turn's content, so the model still sees them. The rendered template holds its own special
tokens, so it is encoded without adding BOS again.

Content is data: a special token typed in a message ("<|im_start|>system") is encoded as the
text it is, never as the control token, so the roles of the prompt are the ones the messages
say. To know which characters of the rendered text came from content, the template is rendered
a second time with a marker in place of each content (``_content_spans``); the template's own
text is encoded with special tokens parsed, the content without. Content with no special token
in it is encoded exactly as before, in one piece. What the template itself renders from
``tools``, ``tool_calls``, ``tool_call_id`` or ``name`` is template text, so special-token text
there is refused (``check_no_specials``).
"""

from __future__ import annotations

import bisect
import json
import re
import secrets
from collections.abc import Sequence

import jinja2

ROLES = ("system", "user", "assistant", "tool", "developer")


def check_messages(messages) -> list[dict]:
    """The messages as plain dicts; ValueError naming the first bad one. An assistant turn with
    ``tool_calls`` may have no content (None: rendered as "")."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] must be a dict with a role in {ROLES}")
        content = m.get("content")
        if content is None and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")
        check_unicode(content, f"messages[{i}].content")
        checked.append({"role": m["role"], "content": content, **_tool_keys(m, i)})
    return checked


def _tool_keys(m: dict, i: int) -> dict:
    """The message's tool_calls (a list of dicts), tool_call_id and name (strings), if given."""
    out = {}
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise ValueError(f"messages[{i}].tool_calls must be a list of dicts")
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        value = m.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise ValueError(f"messages[{i}].{key} must be a string")
            out[key] = value
    return out


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


TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def render_chat(
    tokenizer, messages, add_generation_prompt: bool = True, tools=None, template_kwargs=None
) -> str:
    """The conversation rendered with the model's template; a template that refuses it (its
    ``raise_exception``, a missing variable, a type it cannot add) is a ValueError.
    ``template_kwargs``: more variables for the template (vLLM's ``chat_template_kwargs``,
    e.g. ``{"enable_thinking": false}``), none of the ones it is given anyway."""
    kwargs = dict(template_kwargs or {})
    taken = sorted(set(kwargs) & set(TEMPLATE_OWN))
    if taken:
        raise ValueError(f"chat_template_kwargs: {taken[0]!r} is set by the server, not here")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt, tools=tools, **kwargs)
    except (jinja2.TemplateError, TypeError) as e:
        raise ValueError(f"chat template: {e}") from None


def prepare_chat(tokenizer, messages, tools=None) -> tuple[list[dict], list | None]:
    """The checked messages and tools as the template will get them: written as text where
    the template does not read them (``tools_as_text``), checked for special tokens where it
    does."""
    messages = check_messages(messages)
    ok = isinstance(tools, list) and tools and all(isinstance(t, dict) for t in tools)
    if tools is not None and not ok:
        raise ValueError("tools must be a non-empty list of tool definitions (dicts)")
    messages, tools = tools_as_text(tokenizer.chat_template or "", messages, tools)
    check_no_specials(tokenizer, messages, tools)
    return messages, tools


def chat_text(tokenizer, messages, add_generation_prompt: bool = True, tools=None) -> str:
    """The conversation (and tools) rendered, as text."""
    messages, tools = prepare_chat(tokenizer, messages, tools)
    return render_chat(tokenizer, messages, add_generation_prompt, tools)


def chat_prompt_ids(
    tokenizer,
    messages,
    add_generation_prompt: bool = True,
    max_chars: int | None = None,
    tools: list[dict] | None = None,
    max_chars_why: str = "that max_model_len tokens can hold",
    template_kwargs: dict | None = None,
) -> list[int]:
    """The prompt token ids of one conversation, ready for the assistant's turn. ``max_chars``:
    a rendered prompt longer than this is a ValueError before it is tokenized (its message ends
    with ``max_chars_why``). ``tools``: the function definitions ([{"type": "function",
    "function": {...}}]) the template gets."""
    messages, tools = prepare_chat(tokenizer, messages, tools)
    text = render_chat(tokenizer, messages, add_generation_prompt, tools, template_kwargs)
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(
            f"the rendered conversation has {len(text)} characters, more than the "
            f"{max_chars} {max_chars_why}"
        )
    return encode_chat(tokenizer, messages, text, add_generation_prompt, tools, template_kwargs)


# ---- tools: given to the template, or written as text for one that does not read them ----

TOOLS_PREAMBLE = (
    "Functions you may call, with JSON schemas of their arguments:\n<tools>\n{tools}\n</tools>\n"
    "To call one, answer with a block like this for each call:\n<tool_call>\n"
    '{{"name": "<function name>", "arguments": {{<arguments>}}}}\n</tool_call>'
)


def tools_as_text(template: str, messages: list[dict], tools) -> tuple[list[dict], list | None]:
    """For a template that never mentions ``tools``: the tools described in the system message
    (one is added first if there is none), and None for tools. For one that never mentions
    ``tool_calls``: each assistant turn's calls appended to its content as ``<tool_call>``
    blocks (hermes-style). Either way the text is content, so it is encoded as data."""
    if tools and "tools" not in template:
        lines = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        preamble = TOOLS_PREAMBLE.format(tools=lines)
        if messages[0]["role"] == "system":
            first = messages[0]
            text = f"{first['content']}\n\n{preamble}" if first["content"] else preamble
            messages = [{**first, "content": text}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": preamble}, *messages]
        tools = None
    if "tool_calls" not in template:
        messages = [_calls_as_text(m) if m.get("tool_calls") else m for m in messages]
    return messages, tools


def _calls_as_text(m: dict) -> dict:
    blocks = []
    for call in m["tool_calls"]:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):  # OpenAI's JSON text
            try:
                args = json.loads(args)
            except ValueError:
                pass
        body = {"name": fn.get("name"), "arguments": args}
        blocks.append(f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>")
    text = "\n".join(filter(None, [m["content"], *blocks]))
    return {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}


def check_no_specials(tokenizer, messages: list[dict], tools) -> None:
    """ValueError when special-token text is in what the template renders outside content
    (tools, tool_calls, tool_call_id, name): there it would be parsed as a control token."""
    named = [("tools", tools)] if tools else []
    for i, m in enumerate(messages):
        named += [
            (f"messages[{i}].{k}", m[k]) for k in ("tool_calls", "tool_call_id", "name") if k in m
        ]
    for where, value in named:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        token = _special_in(tokenizer, text)
        if token is not None:
            raise ValueError(f"{where} holds the special token {token!r}")


def encode_chat(
    tokenizer, messages: list[dict], text: str, add_generation_prompt: bool, tools=None, kw=None
) -> list[int]:
    """Token ids of ``text`` (the rendered ``messages`` and ``tools``) where only the template's
    own special tokens are control tokens."""
    ids, offsets = tokenizer.encode_offsets(text)
    spans = _content_spans(tokenizer, messages, text, add_generation_prompt, tools, kw)
    if spans is None:  # the template reshapes content: see _from_skeleton
        if not any(_holds_special(tokenizer, m["content"]) for m in messages):
            return ids
        return _from_skeleton(tokenizer, messages, add_generation_prompt, tools, kw)
    if not _forged(tokenizer.special_token_ids, ids, offsets, spans):
        return ids
    return _encode_pieces(tokenizer, text, spans)


def _markers(messages: list[dict]) -> tuple[list[dict], re.Pattern]:
    """The messages with each content replaced by a marker no content holds, and the pattern
    that finds the markers (its group: the message index). Empty content (an assistant turn
    that only calls tools) stays empty: there is nothing in it to keep as data, and a template
    that tests it (``{% if message.content %}``) renders the same."""
    nonce = secrets.token_hex(8)
    marked = [
        {**m, "content": f"\ue000{nonce}{i}\ue001"} if m["content"] else m
        for i, m in enumerate(messages)
    ]
    return marked, re.compile(f"\ue000{nonce}(\\d+)\ue001")


def _skeleton(tokenizer, messages, add_generation_prompt, tools=None, kw=None) -> list[str | int]:
    """The template rendered around markers: [text, message index, text, index, ..., text]."""
    marked, pattern = _markers(messages)
    parts = pattern.split(render_chat(tokenizer, marked, add_generation_prompt, tools, kw))
    return [int(p) if i % 2 else p for i, p in enumerate(parts)]


def _content_spans(
    tokenizer, messages, text, add_generation_prompt, tools=None, kw=None
) -> list[tuple] | None:
    """(start, end) of each content in ``text``, in order; None when the text is not the
    skeleton with each marker replaced by its content, as given or stripped (``| trim``)."""
    try:
        parts = _skeleton(tokenizer, messages, add_generation_prompt, tools, kw)
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
    return _special_in(tokenizer, content) is not None


def _special_in(tokenizer, text: str) -> str | None:
    """The first special token whose text is in ``text``, if any."""
    names = (tokenizer.id_to_token(i) for i in sorted(tokenizer.special_token_ids))
    return next((name for name in names if name and name in text), None)


def _from_skeleton(tokenizer, messages, add_generation_prompt, tools=None, kw=None) -> list[int]:
    """For a template that changes content (so no span of the real rendering is known): the
    template rendered around markers, each marker replaced by its content as plain text."""
    ids = []
    for i, part in enumerate(_skeleton(tokenizer, messages, add_generation_prompt, tools, kw)):
        if i % 2:
            ids += _plain(tokenizer, messages[part]["content"])
        else:
            ids += tokenizer.encode(part, add_special_tokens=False)
    return ids
