"""Conversations -> prompt token ids through the model's chat template (``LLM.chat``, the server).

A conversation is a list of ``{"role": ..., "content": ...}`` messages (system, user, assistant,
in any number of turns); the rendered template holds its own special tokens, so it is encoded
without adding BOS again.
"""

from __future__ import annotations

from collections.abc import Sequence

ROLES = ("system", "user", "assistant", "tool", "developer")


def check_messages(messages) -> list[dict]:
    """The messages as plain dicts; ValueError naming the first bad one."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] must be a dict with a role in {ROLES}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
        checked.append({"role": m["role"], "content": m["content"]})
    return checked


def is_conversation(messages) -> bool:
    """One conversation (a list of message dicts) rather than a list of conversations."""
    return isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], dict)


def chat_prompt_ids(tokenizer, messages, add_generation_prompt: bool = True) -> list[int]:
    """The prompt token ids of one conversation, ready for the assistant's turn."""
    text = tokenizer.apply_chat_template(check_messages(messages), add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)
