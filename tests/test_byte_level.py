"""The byte-level stream (model_loader/byte_level.py) against tokenizers' own DecodeStream: the
same pieces, token by token, on random ids biased toward lone UTF-8 bytes, a literal U+FFFD,
special tokens and ids past the vocabulary; and which vocabularies get a byte table."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from model_loader.byte_level import ByteLevelStream, gpt2_byte_decoder
from model_loader.tokenizer import IncrementalDetokenizer, Tokenizer

HYPOTHESIS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def decode_stream_pieces(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    """The reference: tokenizers' DecodeStream, "" where it holds back."""
    ds = DecodeStream(skip_special_tokens=skip)
    return [ds.step(tok.backend, i) or "" for i in ids]


def detok_pieces(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, [1], skip_special_tokens=skip)
    assert isinstance(detok._stream.__self__, ByteLevelStream)  # not DecodeStream itself
    return [detok.add(i) for i in ids]


def awkward_ids(tok: Tokenizer):
    """Ids whose bytes alone are not whole characters (lone UTF-8 bytes, a literal U+FFFD),
    the special tokens, ids past the vocabulary, and any id."""
    kept, _ = tok.byte_tables
    lone = [i for i, b in enumerate(kept.raw) if "\ufffd" in b.decode(errors="replace")]
    fffd = [i for i, b in enumerate(kept.raw) if b == "\ufffd".encode()]
    specials = sorted(tok.special_token_ids)
    return st.lists(
        st.one_of(
            st.sampled_from(lone),
            st.sampled_from(fffd),
            st.sampled_from(specials),
            st.integers(tok.vocab_size, tok.vocab_size + 40),
            st.integers(0, tok.vocab_size - 1),
        ),
        max_size=40,
    )


@pytest.fixture(scope="module")
def smol(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="module")
def smol_awkward(smol):
    return awkward_ids(smol)


@HYPOTHESIS
@given(data=st.data(), skip=st.booleans())
def test_byte_level_pieces_are_decode_streams_smollm2(smol, smol_awkward, data, skip):
    ids = data.draw(smol_awkward)
    assert detok_pieces(smol, ids, skip) == decode_stream_pieces(smol, ids, skip)


def test_the_table_holds_a_literal_replacement_char_and_lone_bytes(smol):
    """SmolLM2 has both kinds of awkward id, so the test above meets them."""
    kept, skipped = smol.byte_tables
    assert "\ufffd".encode() in kept.raw  # the character itself
    assert sum(t is None for t in kept.texts) > 100  # lone bytes of split characters
    assert all(skipped.raw[i] == b"" and kept.raw[i] for i in smol.special_token_ids)


def test_a_literal_replacement_char_is_held_as_decode_stream_holds_it(smol):
    fffd = smol.byte_tables[0].raw.index("\ufffd".encode())
    ids = [*smol.encode("a"), fffd, *smol.encode("b"), fffd]
    assert detok_pieces(smol, ids, True) == decode_stream_pieces(smol, ids, True)
    assert detok_pieces(smol, ids, True) == ["a", "", "\ufffdb", ""]


def byte_level_toy() -> Tokenizer:
    """A byte-level BPE of the 256 byte characters, with an added token that has a space in it
    (outside the byte alphabet) and two special tokens."""
    vocab = {c: i for i, c in enumerate(gpt2_byte_decoder())}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken("two words", special=False)])
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("é!", special=True)])
    return Tokenizer(
        backend, bos_token_id=None, eos_token_ids=[], add_bos=False, chat_template=None
    )


@HYPOTHESIS
@given(ids=st.lists(st.integers(0, 262), max_size=40), skip=st.booleans())
def test_byte_level_pieces_are_decode_streams_with_added_tokens(ids, skip):
    tok = byte_level_toy()
    assert detok_pieces(tok, ids, skip) == decode_stream_pieces(tok, ids, skip)


def test_other_decoders_get_no_byte_table():
    """A Metaspace decoder (no byte fallback) streams through DecodeStream itself."""
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "!": 3}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    tok = Tokenizer(backend, bos_token_id=None, eos_token_ids=[], add_bos=False, chat_template=None)
    assert tok.byte_tables is None
    detok = IncrementalDetokenizer(tok, [])
    assert not isinstance(getattr(detok._stream, "__self__", None), ByteLevelStream)
    assert [detok.add(i) for i in (1, 2, 3)] == decode_stream_pieces(tok, [1, 2, 3], True)


def test_a_negative_id_is_refused(smol):
    with pytest.raises(ValueError, match="token id -3 is negative"):
        IncrementalDetokenizer(smol, []).add(-3)
