"""Streaming detokenization for a byte-level BPE vocabulary (GPT-2's byte-to-character map:
SmolLM2, Qwen, Llama 3), in Python over a table of each id's bytes.

Under a byte-level decoder each id stands for fixed bytes (its token's characters mapped back to
the bytes they spell; none for a special token that is skipped; none for an id past the
vocabulary), and the text of ids is the UTF-8 decode of all their bytes, each invalid sequence
replaced by U+FFFD (Rust's ``from_utf8_lossy`` and Python's ``errors="replace"`` replace the same
maximal subparts). tokenizers' ``DecodeStream`` decodes a window of ids twice per token and emits
the window's new text once it is longer and does not end in U+FFFD. Its window starts at the ids
of the piece emitted last, whose bytes never end inside a character (their text did not end in
U+FFFD), so the window's text is that piece and then the text of the bytes held since: the new
text is the decode of the held bytes alone. ``ByteLevelStream`` keeps those bytes and gives the
same pieces (tested against ``DecodeStream`` on random ids), a list lookup per token in the
common case (held bytes none, the id's bytes valid UTF-8 alone) instead of two decodes.
"""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

REPLACEMENT_CHAR = "\ufffd"


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable character standing for a byte to the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class ByteTable:
    """Per id: its bytes (``raw``), and what a stream holding no bytes emits for it at once
    (``texts``): the bytes' text where they are whole characters and the text does not end in
    U+FFFD, "" for no bytes, else None (the stream holds them)."""

    def __init__(self, raw: list[bytes]):
        self.raw = raw
        self.texts = [_at_once(b) for b in raw]


def byte_tables(backend: HFTokenizer) -> tuple[ByteTable, ByteTable] | None:
    """The tables of a byte-level vocabulary, special tokens kept and skipped, checked id by
    id against the backend's own decode; None for any other decoder, or if an id's text is not
    its bytes' text."""
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    to_byte = {ord(c): b for c, b in gpt2_byte_decoder().items()}  # for str.translate
    alphabet = frozenset(map(chr, to_byte))
    n = backend.get_vocab_size(with_added_tokens=True)
    kept = [_token_bytes(backend.id_to_token(i), to_byte, alphabet) for i in range(n)]
    special = [i for i, t in backend.get_added_tokens_decoder().items() if t.special and i < n]
    skipped = list(kept)
    for i in special:
        skipped[i] = b""
    for raw, skip, ids in ((kept, False, range(n)), (skipped, True, special)):
        if any(backend.decode([i], skip_special_tokens=skip) != _lossy(raw[i]) for i in ids):
            return None
    return ByteTable(kept), ByteTable(skipped)


class ByteLevelStream:
    """``DecodeStream.step`` over a ``ByteTable``: ``step(token_id)`` is the new text, or None
    while it is held back (nothing new, or a character still incomplete)."""

    __slots__ = ("texts", "raw", "held")

    def __init__(self, table: ByteTable):
        self.texts, self.raw = table.texts, table.raw
        self.held = b""  # the bytes of the ids since the last piece

    def step(self, token_id: int) -> str | None:
        if not self.held and token_id >= 0:
            try:
                text = self.texts[token_id]
            except IndexError:  # past the vocabulary: no bytes, as tokenizers decodes it
                return None
            if text is not None:
                return text or None  # the common case: whole characters, or no bytes
        return self._step_held(token_id)

    def _step_held(self, token_id: int) -> str | None:
        if token_id < 0:
            raise ValueError(f"token id {token_id} is negative")
        raw = self.raw
        held = self.held = self.held + (raw[token_id] if token_id < len(raw) else b"")
        text = _lossy(held)
        if not text or text[-1] == REPLACEMENT_CHAR:
            return None
        self.held = b""
        return text


def _token_bytes(token: str | None, to_byte: dict[int, int], alphabet: frozenset) -> bytes:
    """A token's bytes: each character's byte, or (a token outside the byte alphabet, such as
    an added token with a space) its UTF-8 as it stands."""
    if token is None:
        return b""
    if alphabet.issuperset(token):
        return token.translate(to_byte).encode("latin-1")
    return token.encode()


def _at_once(b: bytes) -> str | None:
    """The text of bytes that are whole characters, unless it ends in U+FFFD; else None."""
    try:
        text = b.decode()
    except UnicodeDecodeError:
        return None
    return None if text.endswith(REPLACEMENT_CHAR) else text


def _lossy(b: bytes) -> str:
    return b.decode("utf-8", "replace")
