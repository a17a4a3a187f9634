"""``LLM.get_tokenizer()``: the project's Tokenizer behind the methods of a Hugging Face tokenizer.

A thin adapter over ``model_loader.tokenizer.Tokenizer``: ``encode`` / ``decode`` / ``__call__`` /
``apply_chat_template`` with the Hugging Face names and defaults (``decode`` keeps special tokens
unless asked to skip them; ``apply_chat_template`` gives token ids unless ``tokenize=False``), plus
``eos_token_id``, ``bos_token_id``, ``vocab_size`` and ``len()``.
The engine itself uses the wrapped tokenizer (``.tokenizer``).
"""

from __future__ import annotations

from engine.frontend.chat import chat_prompt_ids, chat_text
from engine.sampling_params import is_integer
from model_loader.tokenizer import Tokenizer


def _text(name: str, value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"tokenizer: {name} must be a string, got {type(value).__name__}")
    return value


def _ids(name: str, values) -> list[int]:
    """A list, tuple or 1-D array of non-negative integers as plain ints."""
    values = list(values) if hasattr(values, "__len__") and not isinstance(values, str) else None
    if values is None or not all(is_integer(v) and v >= 0 for v in values):
        raise ValueError(f"tokenizer: {name} must be a list of non-negative integers")
    return [int(v) for v in values]


class HFTokenizerAdapter:
    """Encodes and decodes like a Hugging Face tokenizer; wraps the engine's ``Tokenizer``."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    @property
    def eos_token_id(self) -> int | None:
        ids = self.tokenizer.eos_token_ids
        return ids[0] if ids else None

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    @property
    def eos_token(self) -> str | None:
        return self._token(self.eos_token_id)

    @property
    def bos_token(self) -> str | None:
        return self._token(self.bos_token_id)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self.tokenizer.special_token_ids)

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template

    def __len__(self) -> int:
        return self.tokenizer.vocab_size

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokenizer.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text (BOS first when the model adds one and add_special_tokens)."""
        return self.tokenizer.encode(_text("text", text), add_special_tokens=add_special_tokens)

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        """The text of token_ids (a list, tuple or 1-D array, or one id)."""
        ids = _ids("token_ids", [token_ids] if is_integer(token_ids) else token_ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def __call__(self, text, add_special_tokens: bool = True) -> dict:
        """{"input_ids", "attention_mask"} for one text, or lists of them for a list of texts."""
        if isinstance(text, list | tuple):
            rows = [self.encode(t, add_special_tokens) for t in text]
            return {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}
        ids = self.encode(text, add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def convert_ids_to_tokens(self, ids):
        if is_integer(ids):
            return self._token(int(ids))
        return [self._token(i) for i in _ids("ids", ids)]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.tokenizer.token_to_id(tokens)
        return [self.tokenizer.token_to_id(_text("tokens", t)) for t in tokens]

    def apply_chat_template(
        self,
        conversation,
        tools: list | None = None,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **_,
    ) -> str | list[int]:
        """The conversation (and ``tools``) rendered with the model's chat template: its token
        ids (the template holds its own specials: no BOS is added; specials typed in content
        stay text), or with tokenize=False the text."""
        if tokenize:
            return chat_prompt_ids(self.tokenizer, conversation, add_generation_prompt, tools=tools)
        return chat_text(self.tokenizer, conversation, add_generation_prompt, tools)
