"""GGUF ``llama`` (SentencePiece BPE) tokenizers against sentencepiece itself: a tiny model
trained here, written to a GGUF, read back through our loader; ids, decodes and streams compared."""

from __future__ import annotations

import io
import random
import struct

import gguf
import pytest
import sentencepiece as spm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_loader.gguf_file import read_metadata
from model_loader.tokenizer import Tokenizer
from tests.test_tokenizer import stream

HYPOTHESIS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
TRAIN = [
    "the quick brown fox jumps over the lazy dog 0123456789",
    "hello world, hello there! how are you today?",
    "a sunset is extremely beautiful, isn't it? café naïve crème brûlée",
    "東京タワーは高い。東京の夜景はきれいです。",
    "numbers: 3.14159, 2,718 and 42% of 1000",
    "once upon a time in a land far away there lived a small language model 🙂",
    "Ünïcödé straße façade über jalapeño",
]
# Spaces at both ends and in runs, newlines, tabs, and characters never seen in training (they
# fall back to <0xNN> byte tokens).
TEXTS = [
    *TRAIN,
    "",
    " ",
    "   ",
    "  leading spaces",
    "trailing spaces  ",
    "a  b   c    d",
    "line\nbreak\n\nand a blank line\n",
    "\ttabbed\r\n",
    "Ω≈ç√ 🎉🚀 ăîșț",
    "你好世界 δοκιμή Привет",
    "foxfoxfoxfox the the  the ",
    "x",
    "99 red balloons, 1,000,000!",
    "emoji 🙂🙂 and 👍🏽 skin tone",
]
ALPHABET = sorted(set("".join(TRAIN)) | set(" \n\t\r\u00a0\u3000\ufeffé🎉😀\x00"))
SP_TEXT = st.text(st.sampled_from(ALPHABET), max_size=40)
TOKEN_TYPES = {"unknown": 2, "control": 3, "byte": 6, "unused": 5}  # else normal (1)


def train_sentencepiece(add_dummy_prefix: bool, model=None) -> spm.SentencePieceProcessor:
    """A tiny SentencePiece BPE model with byte fallback, set up like LLaMA's (no normalization,
    spaces kept as they are, digits split)."""
    model = io.BytesIO() if model is None else model
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN * 8),
        model_writer=model,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        add_dummy_prefix=add_dummy_prefix,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def token_type(sp: spm.SentencePieceProcessor, i: int) -> int:
    checks = {"unknown": sp.is_unknown, "control": sp.is_control, "byte": sp.is_byte}
    checks["unused"] = sp.is_unused
    return next((TOKEN_TYPES[k] for k, check in checks.items() if check(i)), 1)


def write_tokenizer_gguf(path, sp: spm.SentencePieceProcessor, add_space_prefix: bool):
    """A GGUF holding only the tokenizer metadata llama.cpp's converter writes for LLaMA."""
    n = sp.get_piece_size()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([token_type(sp, i) for i in range(n)])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["space_prefix", "no_space_prefix"])
def pair(request, tmp_path_factory):
    """(sentencepiece, our tokenizer read from a GGUF of the same model)."""
    sp = train_sentencepiece(add_dummy_prefix=request.param)
    path = write_tokenizer_gguf(tmp_path_factory.mktemp("spm") / "t.gguf", sp, request.param)
    return sp, Tokenizer.from_gguf(read_metadata(gguf.GGUFReader(str(path))))


def check_same(sp: spm.SentencePieceProcessor, tok: Tokenizer, text: str):
    ids = sp.encode(text)
    assert tok.encode(text) == [sp.bos_id(), *ids], text
    assert tok.encode(text, add_special_tokens=False) == ids, text
    assert tok.decode(ids) == sp.decode(ids), text
    if "\u2581" not in text:  # a literal "▁" reads back as a space, in sentencepiece too
        assert tok.decode([sp.bos_id(), *ids]) == text
    assert "".join(stream(tok, ids)) == tok.decode(ids)


def test_the_model_is_not_trivial(pair):
    sp, tok = pair
    assert tok.vocab_size == sp.get_piece_size() == 400
    pieces = [sp.id_to_piece(i) for i in sp.encode(" ".join(TEXTS))]
    assert sum(len(p) > 2 for p in pieces) > 50  # many merged pieces...
    assert any(sp.is_byte(i) for i in sp.encode("Ω≈ç√ 🎉🚀 ăîșț"))  # ...and byte fallback


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_text_match_sentencepiece(pair, text):
    check_same(*pair, text)


@HYPOTHESIS
@given(text=SP_TEXT)
def test_any_text_matches_sentencepiece(pair, text):
    check_same(*pair, text)


@HYPOTHESIS
@given(data=st.data(), skip=st.booleans())
def test_random_ids_stream_equals_decode(pair, data, skip):
    _, tok = pair
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30))
    assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_special_tokens_and_bos_policy(pair):
    sp, tok = pair
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (1, [2], True)
    assert tok.special_token_ids == {0, 1, 2}
    # Control tokens written in the text are one id each (llama.cpp parses them too).
    hi = sp.encode("hi")
    assert tok.encode("<s>hi</s>", add_special_tokens=False) == [1, *hi, 2]
    assert tok.decode([1, *hi, 2], skip_special_tokens=False).endswith("hi</s>")


def metadata(sp: spm.SentencePieceProcessor, **changes) -> dict:
    n = sp.get_piece_size()
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [token_type(sp, i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
    }
    return {**md, **changes}


def test_metadata_defaults_and_errors():
    sp = train_sentencepiece(add_dummy_prefix=True)  # add_space_prefix defaults to true
    tok = Tokenizer.from_gguf(metadata(sp, **{"tokenizer.ggml.add_bos_token": False}))
    assert not tok.add_bos and tok.encode("fox") == sp.encode("fox")
    with pytest.raises(ValueError, match="'tokenizer.ggml.scores'"):
        Tokenizer.from_gguf(metadata(sp, **{"tokenizer.ggml.scores": []}))
    with pytest.raises(ValueError, match="400 tokenizer.ggml.tokens but 3 scores"):
        Tokenizer.from_gguf(metadata(sp, **{"tokenizer.ggml.scores": [0.0] * 3}))
    with pytest.raises(ValueError, match="unknown_token_id 999"):
        Tokenizer.from_gguf(metadata(sp, **{"tokenizer.ggml.unknown_token_id": 999}))


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        byte = buf[pos]
        n, pos, shift = n | (byte & 0x7F) << shift, pos + 1, shift + 7
        if byte < 0x80:
            return n, pos


def with_scores(sp: spm.SentencePieceProcessor, proto: bytes, scores: list[float]) -> bytes:
    """The model's ModelProto bytes with new piece scores (field 1: pieces; in each piece,
    1: text, 2: score, 3: type), written by hand as the protobuf package is not installed."""
    out, pos, i = bytearray(), 0, 0
    while pos < len(proto):  # every top-level field is length-delimited
        key, pos = read_varint(proto, pos)
        length, pos = read_varint(proto, pos)
        body, pos = proto[pos : pos + length], pos + length
        if key >> 3 == 1:
            text = sp.id_to_piece(i).encode()
            body = b"\x0a" + varint(len(text)) + text + b"\x15" + struct.pack("<f", scores[i])
            body += b"\x18" + varint(token_type(sp, i))
            i += 1
        out += varint(key) + varint(len(body)) + body
    return bytes(out)


def test_merges_follow_the_scores_not_the_ids():
    """Shuffle the scores of the merged pieces: sentencepiece and we still agree, and differently
    from before (sentencepiece's own scores fall with the id, so they can't tell the two apart)."""
    model = io.BytesIO()
    train_sentencepiece(add_dummy_prefix=True, model=model)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    scores = [sp.get_score(i) for i in range(sp.get_piece_size())]
    merged = [i for i, s in enumerate(scores) if token_type(sp, i) == 1 and s < 0]
    shuffled_scores = random.Random(0).sample([scores[i] for i in merged], len(merged))
    for i, s in zip(merged, shuffled_scores, strict=True):
        scores[i] = s
    shuffled = spm.SentencePieceProcessor(model_proto=with_scores(sp, model.getvalue(), scores))
    tok = Tokenizer.from_gguf(metadata(sp, **{"tokenizer.ggml.scores": scores}))
    assert sum(sp.encode(t) != shuffled.encode(t) for t in TEXTS) >= 3
    for text in TEXTS:
        check_same(shuffled, tok, text)
