"""Text <-> token ids, chat templates, and streaming (incremental) detokenization.

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` built either from a Hugging Face ``tokenizer.json``
or, for GGUF files, from the metadata: a byte-level BPE (``gpt2``: vocabulary and merges) or a
SentencePiece BPE with byte fallback (``llama``: vocabulary, scores and token types). BOS is
added only when the model's own files say so. ``IncrementalDetokenizer`` turns generated ids into
text piece by piece.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from model_loader.byte_level import ByteLevelStream, ByteTable, byte_tables

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:
    DecodeStream = None

# tokenizer.ggml.token_type values
GGUF_NORMAL, GGUF_UNKNOWN, GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_BYTE = 1, 2, 3, 4, 6
SPM_SPACE = "\u2581"  # "▁": SentencePiece's stand-in for a space

# From this many characters (or ids) text is encoded (decoded) with tokenizers' batch call, a
# batch of one: its plain encode holds the GIL for all of its work (seconds for megabytes), the
# batch call lets the other threads run meanwhile (a server's event loop, the engine thread).
LONG_TEXT = 1 << 14
REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece byte-fallback tokens


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what the model's files say about BOS, EOS and chat."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        add_bos: bool,
        chat_template: str | None,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        self.special_token_ids = frozenset(i for i, t in added.items() if t.special)
        self._template: jinja2.Template | None = None
        self._one: dict[tuple[int, bool], str] = {}  # (id, skip_special_tokens) -> its text

    # --- constructors -------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From ``tokenizer.json`` and, when present, ``tokenizer_config.json`` (BOS/EOS tokens,
        ``add_bos_token``, chat template) and ``generation_config.json`` / ``config.json`` (EOS)."""
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise ValueError(f"{path}: no tokenizer.json")
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        tok_cfg = _read_json(path / "tokenizer_config.json")
        bos_id = _token_id(backend, tok_cfg.get("bos_token"))
        if bos_id is None:
            bos_id = _read_json(path / "config.json").get("bos_token_id")
        eos = [_token_id(backend, tok_cfg.get("eos_token"))]
        for name in ("generation_config.json", "config.json"):
            eos += _as_list(_read_json(path / name).get("eos_token_id"))
        add_bos = tok_cfg.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds_bos(backend, bos_id)
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=_unique(eos),
            add_bos=bool(add_bos),
            chat_template=_hf_chat_template(path, tok_cfg),
        )

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> Tokenizer:
        """From GGUF ``tokenizer.*`` metadata: byte-level BPE (``gpt2``) or SentencePiece BPE
        (``llama``). BOS is added by default for ``llama`` only, as llama.cpp does."""
        kind = metadata.get("tokenizer.ggml.model")
        builders = {"gpt2": _byte_level_bpe_from_gguf, "llama": _sentencepiece_bpe_from_gguf}
        if kind not in builders:
            raise ValueError(f"gguf: tokenizer.ggml.model {kind!r} is not supported (gpt2, llama)")
        eos = [
            metadata.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        ]
        return cls(
            builders[kind](metadata),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_unique(eos),
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")),
            chat_template=metadata.get("tokenizer.chat_template"),
        )

    # --- text <-> ids -------------------------------------------------------------------------

    def encode(
        self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False
    ) -> list[int]:
        """Token ids of ``text``; BOS first when the model adds one and add_special_tokens.

        Special tokens written in the text ("<|im_start|>") map to their own ids either way,
        unless split_special_tokens: then they are read as plain text (what user text is).
        A rendered chat template holds its own specials: encode it with add_special_tokens=False.
        """
        ids = self._encoding(text, split_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text`` (special tokens parsed, no BOS) and the (start, end) characters
        of ``text`` each one covers."""
        encoding = self._encoding(text, split_special_tokens=False)
        return encoding.ids, encoding.offsets

    def _encoding(self, text: str, split_special_tokens: bool):
        backend = self._plain_backend if split_special_tokens else self.backend
        if len(text) < LONG_TEXT:
            return backend.encode(text, add_special_tokens=False)
        _quiet_parallelism()
        return backend.encode_batch([text], add_special_tokens=False)[0]

    @functools.cached_property
    def _plain_backend(self) -> HFTokenizer:
        """A copy of the backend that spells special tokens out as text (never their ids)."""
        plain = HFTokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if len(ids) < LONG_TEXT:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        _quiet_parallelism()
        return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def decode_one(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """``decode([token_id])``, remembered (a detokenizer decodes one id at every token)."""
        key = (token_id, skip_special_tokens)
        text = self._one.get(key)
        if text is None:
            text = self._one[key] = self.decode([token_id], skip_special_tokens)
        return text

    @functools.cached_property
    def byte_token_ids(self) -> frozenset[int]:
        """Ids of the byte-fallback tokens (``<0xNN>``)."""
        hexes = "0123456789ABCDEFabcdef"  # every spelling BYTE_TOKEN matches
        names = (f"<0x{a}{b}>" for a in hexes for b in hexes)
        ids = map(self.backend.token_to_id, names)
        return frozenset(i for i in ids if i is not None)

    @functools.cached_property
    def byte_tables(self) -> tuple[ByteTable, ByteTable] | None:
        """Each id's bytes, special tokens kept and skipped, for a byte-level vocabulary (None
        for any other): model_loader/byte_level.py."""
        return byte_tables(self.backend)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # --- chat -----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **template_kwargs,
    ) -> str:
        """Render ``messages`` ([{"role", "content"}, ...]) with the model's Jinja chat template;
        ``tools`` (function definitions, as transformers passes them) is the template's too, and
        so are ``template_kwargs`` (``enable_thinking=False``, ...)."""
        if self.chat_template is None:
            raise ValueError("tokenizer: the model has no chat_template")
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        return self._template.render(
            **template_kwargs,
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
        )

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")


class IncrementalDetokenizer:
    """Streams the text of generated ids, one token at a time.

    The pieces returned by ``add`` (then ``finish``) concatenate to exactly
    ``tokenizer.decode(output_ids)``. Each step decodes only a short window: the ids since the last
    emitted piece plus the ids of that piece (so a decoder that strips a leading space strips it
    in both decodes and the difference stays right). While the window's text ends in U+FFFD, a
    multi-byte character is still incomplete and nothing is emitted. Nor while the last id is a
    byte-fallback token (``<0xNN>``): tokenizers' ByteFallback decoder turns a whole run of them
    into U+FFFDs when any byte of the run is invalid, so a run's text is final once it ends.

    A tokenizer without byte-fallback tokens streams as tokenizers' own ``DecodeStream`` does
    (the same pieces): a byte-level BPE (SmolLM2, Qwen, Llama 3) over a table of each id's bytes
    (model_loader/byte_level.py: a list lookup a token in the common case), any other through
    ``DecodeStream`` itself (two decodes of the window in Rust); its end (``finish``) is the
    whole decode's tail past the text emitted.

    The detokenizer keeps the ids, not the text: its caller joins the pieces (``emitted`` counts
    their characters).
    """

    __slots__ = (
        *("tokenizer", "prompt_ids", "skip_special_tokens", "output_ids", "emitted"),
        *("_prefix", "_read", "_stream"),
    )

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens=True):
        self.tokenizer = tokenizer
        self.prompt_ids = list(prompt_ids)  # kept for callers; the stream is the output's text
        self.skip_special_tokens = skip_special_tokens
        self.output_ids: list[int] = []
        self.emitted = 0  # characters of text returned so far (the caller keeps the text)
        self._prefix = 0  # output_ids[_prefix:_read] produced the last emitted piece
        self._read = 0  # output_ids[_read:] have not been emitted yet
        # token id -> its new text or None: where a stream decodes this vocabulary right
        self._stream = None if tokenizer.byte_token_ids else _stream(tokenizer, skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        if len(ids) == 1:
            return self.tokenizer.decode_one(ids[0], self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated id; return the newly completed text ("" while holding back)."""
        token_id = int(token_id)
        self.output_ids.append(token_id)
        stream = self._stream
        if stream is None:
            return self._emit(final=False)
        piece = stream(token_id)
        if piece is None:
            return ""
        self.emitted += len(piece)
        return piece

    def add_last(self, token_ids: list[int]) -> str:
        """Append the stream's last ids and end it: the text ``add`` for each then ``finish``
        would return; one decode when nothing was added before."""
        if self.output_ids:
            return "".join(map(self.add, token_ids)) + self.finish()
        self.output_ids = [int(t) for t in token_ids]
        self._prefix = self._read = len(self.output_ids)
        piece = self._decode(self.output_ids)
        self.emitted += len(piece)
        return piece

    def finish(self) -> str:
        """Whatever is still held back (an incomplete or invalid UTF-8 tail), at end of stream."""
        if self._stream is None:
            return self._emit(final=True)
        whole = self.tokenizer.decode(self.output_ids, self.skip_special_tokens)
        assert len(whole) >= self.emitted, "the streamed text is longer than the decode"
        piece = whole[self.emitted :]
        self.emitted = len(whole)
        return piece

    def _in_byte_run(self) -> bool:
        """Whether the last id the decoder sees (skipped specials aside) is a byte token."""
        skipped = self.tokenizer.special_token_ids if self.skip_special_tokens else frozenset()
        for i in reversed(self.output_ids):
            if i not in skipped:
                return i in self.tokenizer.byte_token_ids
        return False

    def _emit(self, final: bool) -> str:
        before = self._decode(self.output_ids[self._prefix : self._read])
        window = self._decode(self.output_ids[self._prefix :])
        pending = window.endswith(REPLACEMENT_CHAR) or self._in_byte_run()
        if len(window) <= len(before) or (pending and not final):
            return ""
        piece = window[len(before) :]
        self._prefix, self._read = self._read, len(self.output_ids)
        self.emitted += len(piece)
        return piece


# --- helpers ----------------------------------------------------------------------------------


def _stream(tokenizer: Tokenizer, skip_special_tokens: bool):
    """A stream's step (token id -> new text or None) for a vocabulary without byte-fallback
    tokens: over the byte table of a byte-level one, else tokenizers' DecodeStream; None if
    neither is there."""
    tables = tokenizer.byte_tables
    if tables is not None:
        return ByteLevelStream(tables[skip_special_tokens]).step
    if DecodeStream is None:
        return None
    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    return functools.partial(stream.step, tokenizer.backend)


def _quiet_parallelism() -> None:
    """A batch call counts as parallelism used, and tokenizers then warns on every later fork
    unless TOKENIZERS_PARALLELISM is set; a batch of one has nothing to run in parallel."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _as_list(value) -> list:
    return [] if value is None else (list(value) if isinstance(value, list) else [value])


def _unique(ids) -> list[int]:
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _token_id(backend: HFTokenizer, token) -> int | None:
    """Id of a tokenizer_config token entry (a string, or a dict with "content")."""
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def _post_processor_adds_bos(backend: HFTokenizer, bos_id: int | None) -> bool:
    """Whether tokenizer.json's post-processor puts BOS in front (e.g. a TemplateProcessing)."""
    if bos_id is None:
        return False
    with_special = backend.encode("a", add_special_tokens=True).ids
    plain = backend.encode("a", add_special_tokens=False).ids
    return len(with_special) > len(plain) and with_special[0] == bos_id


def _hf_chat_template(path: Path, tok_cfg: dict) -> str | None:
    """tokenizer_config's chat_template (a string, or named templates: take "default"), else
    a chat_template.jinja file."""
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    return template


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _jinja_env() -> jinja2.Environment:
    """A sandboxed environment configured the way transformers renders chat templates."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


# GGUF tokenizer.ggml.pre -> the Hugging Face pre-tokenizer it stands for.
def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt-2", "gpt2"):
        return byte_level
    if pre == "smollm":  # digits split one by one before the byte-level split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    raise ValueError(f"gguf: tokenizer.ggml.pre {pre!r} is not supported yet (smollm, gpt-2)")


def _required(md: dict[str, Any], key: str) -> list:
    value = md.get(key)
    if not value:
        raise ValueError(f"gguf: missing required metadata key {key!r}")
    return list(value)


def _byte_level_bpe_from_gguf(md: dict[str, Any]) -> HFTokenizer:
    """The tokenizers.Tokenizer equivalent to a GGUF ``gpt2`` vocabulary."""
    tokens = _required(md, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in md.get("tokenizer.ggml.merges", [])]
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None:
        raise ValueError(f"gguf: tokenizer.ggml.merges entry {' '.join(bad)!r} is not 'a b'")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _gguf_pre_tokenizer(md.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    _add_gguf_specials(backend, tokens, md.get("tokenizer.ggml.token_type", []))
    return backend


def _add_gguf_specials(backend: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (type 3) become special tokens, user-defined ones (4) added tokens, so
    "<|im_start|>" in text is one id and never split by the BPE."""
    control = [t for t, k in zip(tokens, types, strict=False) if k == GGUF_CONTROL]
    user = [t for t, k in zip(tokens, types, strict=False) if k == GGUF_USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _sentencepiece_bpe_from_gguf(md: dict[str, Any]) -> HFTokenizer:
    """The tokenizers.Tokenizer equivalent to a GGUF ``llama`` (SentencePiece BPE) vocabulary:
    what transformers' LlamaTokenizerFast is. Spaces become "▁" (one in front of each run of
    text, when add_space_prefix), pieces merge by score, characters outside the vocabulary fall
    back to <0xNN> byte tokens; decoding undoes it all and drops the front space again."""
    tokens = _required(md, "tokenizer.ggml.tokens")
    scores = _required(md, "tokenizer.ggml.scores")
    types = md.get("tokenizer.ggml.token_type") or [GGUF_NORMAL] * len(tokens)
    if len(scores) != len(tokens) or len(types) != len(tokens):
        raise ValueError(
            f"gguf: {len(tokens)} tokenizer.ggml.tokens but {len(scores)} scores "
            f"and {len(types)} token types"
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk = _spm_unk_token(md, tokens, types)
    model = models.BPE(
        vocab=vocab,
        merges=_spm_merges(tokens, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = HFTokenizer(model)
    space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(SPM_SPACE)] if space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPM_SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if space_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    specials = [t for t, k in zip(tokens, types, strict=True) if k == GGUF_UNKNOWN]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    _add_gguf_specials(backend, tokens, types)
    return backend


def _spm_unk_token(md: dict[str, Any], tokens: list[str], types: list[int]) -> str | None:
    """The unknown token: tokenizer.ggml.unknown_token_id, else the one of type 2, else none."""
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None:
        unk_id = next((i for i, k in enumerate(types) if k == GGUF_UNKNOWN), None)
    if unk_id is not None and not 0 <= unk_id < len(tokens):
        raise ValueError(f"gguf: tokenizer.ggml.unknown_token_id {unk_id} is out of range")
    return None if unk_id is None else tokens[unk_id]


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple]:
    """BPE merges that reproduce SentencePiece's encoding: every split of a token into two
    vocabulary pieces, the merges of higher-scoring tokens first (ties: lower id first).
    SentencePiece never merges into unknown, control or byte tokens, so neither do we."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    never = (GGUF_UNKNOWN, GGUF_CONTROL, GGUF_BYTE)
    ranked = []  # (-score, token id, left id, left, right)
    for i, tok in enumerate(tokens):
        if types[i] in never:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
