"""Tokenizer: BOS policy, GGUF-built tokenizers against transformers' ids, chat templates, and
incremental detokenization (streamed pieces == the full decode, split UTF-8 included)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, processors
from tokenizers import Tokenizer as HFTokenizer

from engine.golden import read_golden
from model_loader.synthetic import CHATML, CORPUS
from model_loader.tokenizer import IncrementalDetokenizer, Tokenizer

HYPOTHESIS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
MIXED_TEXT = "naïve café 東京タワー 🙂👍🏽 ∑x² — ok"


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return Tokenizer.from_hf_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def smol(smollm2):
    """SmolLM2's tokenizer, built from its GGUF metadata: Tokenizer.from_gguf(read_metadata(
    GGUFReader(file))), as the session's loaded SmolLM2 built it (reading the file: ~4 s)."""
    return smollm2.tokenizer


def partial_ids(tok: Tokenizer) -> list[int]:
    """Ids whose text alone is an incomplete UTF-8 sequence (lone bytes of multi-byte chars)."""
    return [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens=True) -> list[str]:
    """The pieces an IncrementalDetokenizer returns for ids, then its finish()."""
    detok = IncrementalDetokenizer(tok, [5, 6], skip_special_tokens=skip_special_tokens)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.finish())
    assert detok.emitted == len("".join(pieces))
    return pieces


# --- Hugging Face directories: BOS policy -----------------------------------------------------


def test_tiny_tokenizer_from_hf_dir(tiny):
    eos = tiny.token_to_id("<|endoftext|>")
    assert (tiny.bos_token_id, tiny.eos_token_ids, tiny.add_bos) == (eos, [eos], False)
    assert tiny.chat_template == CHATML
    for text in CORPUS:
        ids = tiny.encode(text)
        assert eos not in ids and tiny.decode(ids) == text
    assert tiny.encode("<|im_start|>") == [tiny.token_to_id("<|im_start|>")]


def with_tokenizer_files(src: Path, dst: Path, tok_cfg_changes=None, post_processor=None) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(tok_cfg_changes or {})
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    if post_processor is not None:
        backend = HFTokenizer.from_file(str(dst / "tokenizer.json"))
        backend.post_processor = post_processor
        backend.save(str(dst / "tokenizer.json"))
    return dst


def test_bos_from_tokenizer_config(tiny_model_dir, tmp_path):
    d = with_tokenizer_files(tiny_model_dir, tmp_path / "bos", {"add_bos_token": True})
    tok = Tokenizer.from_hf_dir(d)
    plain = tok.encode(CORPUS[0], add_special_tokens=False)
    assert tok.encode(CORPUS[0]) == [tok.bos_token_id, *plain]
    assert tok.bos_token_id not in plain


def test_bos_from_post_processor_when_config_is_silent(tiny_model_dir, tmp_path):
    eos = "<|endoftext|>"
    template = processors.TemplateProcessing(single=f"{eos} $A", special_tokens=[(eos, 0)])
    silent = {"add_bos_token": None}
    d = with_tokenizer_files(tiny_model_dir, tmp_path / "pp", silent, template)
    assert Tokenizer.from_hf_dir(d).encode("hi") == [
        0,
        *Tokenizer.from_hf_dir(d).encode("hi", False),
    ]
    d = with_tokenizer_files(tiny_model_dir, tmp_path / "none", silent)
    assert not Tokenizer.from_hf_dir(d).add_bos
    d = with_tokenizer_files(tiny_model_dir, tmp_path / "off", {"add_bos_token": False}, template)
    assert Tokenizer.from_hf_dir(d).encode("hi")[0] != 0  # the config wins over the processor


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# --- GGUF: SmolLM2 against transformers' ids (golden) ------------------------------------------


def test_smollm2_matches_transformers_ids(smol):
    golden = read_golden("smollm2")
    for case in golden["tokenizer_cases"]:
        assert smol.encode(case["text"], case["add_special_tokens"]) == case["ids"], case["text"]
    for case in golden["cases"]:
        prompt = (
            smol.apply_chat_template(case["messages"]) if "messages" in case else case["prompt"]
        )
        assert prompt == case["prompt"]
        assert smol.encode(prompt, case["add_special_tokens"]) == case["prompt_token_ids"]
        assert smol.decode(case["token_ids"]) == case["text"]


def test_smollm2_special_and_digit_tokens(smol):
    assert (smol.bos_token_id, smol.eos_token_ids, smol.add_bos) == (1, [2], False)
    assert smol.encode("<|im_start|>user<|im_end|>") == [1, smol.encode("user")[0], 2]
    assert [smol.decode([i]) for i in smol.encode("x 2025")] == ["x", " ", "2", "0", "2", "5"]
    assert smol.decode([1, 2], skip_special_tokens=False) == "<|im_start|><|im_end|>"
    assert smol.decode([1, 2]) == ""


def gguf_md(**changes):
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab", "<s>"],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.token_type": [1, 1, 1, 3],
    }
    return {**md, **changes}


def test_gguf_tokenizer_types_and_errors():
    tok = Tokenizer.from_gguf(gguf_md())
    assert tok.encode("ab<s>ba") == [2, 3, 1, 0] and tok.eos_token_ids == []
    with pytest.raises(ValueError, match="'tokenizer.ggml.scores'"):  # llama needs scores
        Tokenizer.from_gguf(gguf_md(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(ValueError, match="'bert'"):
        Tokenizer.from_gguf(gguf_md(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'qwen2'"):
        Tokenizer.from_gguf(gguf_md(**{"tokenizer.ggml.pre": "qwen2"}))
    with pytest.raises(ValueError, match="merges entry 'a b c'"):
        Tokenizer.from_gguf(gguf_md(**{"tokenizer.ggml.merges": ["a b c"]}))


# --- chat templates ----------------------------------------------------------------------------


def test_chat_template_renders_chatml(tiny):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    assert tiny.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert tiny.apply_chat_template(messages) == expected + "<|im_start|>assistant\n"
    ids = tiny.encode(tiny.apply_chat_template(messages), add_special_tokens=False)
    assert ids.count(tiny.token_to_id("<|im_start|>")) == 3


def custom(tok: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(
        tok.backend,
        bos_token_id=tok.bos_token_id,
        eos_token_ids=tok.eos_token_ids,
        add_bos=tok.add_bos,
        chat_template=template,
    )


def test_chat_template_environment(smol):
    tpl = custom(smol, "{{ bos_token }}|{{ eos_token }}|{{ messages | tojson }}")
    rendered = tpl.apply_chat_template([{"role": "user", "content": "東京"}])
    assert rendered == '<|im_start|>|<|im_end|>|[{"role": "user", "content": "東京"}]'
    strict = custom(
        smol,
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok",
    )
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(jinja2.TemplateError, match="user first"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="no chat_template"):
        custom(smol, None).apply_chat_template([])


# --- incremental detokenization ----------------------------------------------------------------


def check_text_streams(tok: Tokenizer, text: str):
    # special tokens' spellings as plain text: "<|im_end|>" parsed would be the special token,
    # which decoding skips (Hypothesis draws string constants from the code, so it tries them)
    ids = tok.encode(text, add_special_tokens=False, split_special_tokens=True)
    pieces = stream(tok, ids)
    assert "".join(pieces) == text == tok.decode(ids)
    assert pieces[-1] == "" and not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("which", ["tiny", "smol"])
def test_multibyte_chars_split_across_tokens_stream_whole(which, request):
    tok = request.getfixturevalue(which)
    ids = tok.encode(MIXED_TEXT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some characters really are split
    check_text_streams(tok, MIXED_TEXT)


# A literal U+FFFD at the end is held back until finish(): keep it out of the streamed text.
ANY_TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=40)


@HYPOTHESIS
@given(text=ANY_TEXT)
def test_any_text_streams_back_tiny(tiny, text):
    check_text_streams(tiny, text)


# SmolLM2's vocabulary lacks a few bytes (0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, and the lead bytes
# 0xf1, 0xf2 of U+40000..U+BFFFF): text with them can't be encoded, by transformers either.
SMOLLM2_TEXT = st.text(
    st.characters(
        codec="utf-8", max_codepoint=0x3FFFF, exclude_characters="\x04\x06\x13\x14\x16\x1d\ufffd"
    ),
    max_size=40,
)


@HYPOTHESIS
@given(text=SMOLLM2_TEXT)
def test_any_text_streams_back_smollm2(smol, text):
    check_text_streams(smol, text)


def random_ids(tok: Tokenizer):
    """Any ids, biased toward lone UTF-8 bytes so characters split and invalid bytes occur."""
    lone = st.sampled_from(partial_ids(tok))
    return st.lists(st.one_of(lone, st.integers(0, tok.vocab_size - 1)), max_size=30)


@pytest.fixture(scope="module")
def tiny_ids(tiny):
    return random_ids(tiny)


@pytest.fixture(scope="module")
def smol_ids(smol):
    return random_ids(smol)


@HYPOTHESIS
@given(data=st.data(), skip=st.booleans())
def test_random_ids_stream_equals_decode_tiny(tiny, tiny_ids, data, skip):
    ids = data.draw(tiny_ids)
    assert "".join(stream(tiny, ids, skip)) == tiny.decode(ids, skip_special_tokens=skip)


@HYPOTHESIS
@given(data=st.data(), skip=st.booleans())
def test_random_ids_stream_equals_decode_smollm2(smol, smol_ids, data, skip):
    ids = data.draw(smol_ids)
    assert "".join(stream(smol, ids, skip)) == smol.decode(ids, skip_special_tokens=skip)


@pytest.fixture(scope="module")
def sentencepiece_like():
    """A LLaMA-style decoder: '▁' -> ' ', byte-fallback tokens <0xNN>, first space stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁hello": 3, "▁world": 4, "!": 5, "▁": 6}
    vocab.update({f"<0x{b:02X}>": 7 + b for b in range(256)})
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], add_bos=True, chat_template=None)


@HYPOTHESIS
@given(ids=st.lists(st.integers(0, 7 + 255), max_size=30), skip=st.booleans())
def test_stream_with_leading_space_stripping_decoder(sentencepiece_like, ids, skip):
    tok = sentencepiece_like
    assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_stream_pieces_are_the_new_text_only(sentencepiece_like):
    emoji = [7 + b for b in "🙂".encode()]  # four byte tokens, one character
    pieces = stream(sentencepiece_like, [3, 4, *emoji, 5, 3, *emoji])
    # a run of byte tokens is held until it ends (a later invalid byte would spoil all of it)
    assert pieces == ["hello", " world", "", "", "", "", "🙂!", " hello", "", "", "", "", "🙂"]
    assert (
        sentencepiece_like.decode([7 + 0xF0, 7 + 0x9F, 7 + 0x99, 7 + 0x82, 7 + 0x80])
        == "\ufffd" * 5
    )


def test_byte_level_vocabularies_stream_by_their_bytes_and_byte_fallback_ones_by_windows(
    smol, sentencepiece_like
):
    """SmolLM2 (byte-level BPE) streams over its table of each id's bytes (against tokenizers'
    DecodeStream: tests/test_byte_level.py); a vocabulary with byte-fallback tokens through the
    window decodes that hold a byte run back. Both equal the whole decode, an incomplete UTF-8
    tail included (random ids: the tests above)."""
    assert smol.byte_tables is not None and sentencepiece_like.byte_tables is None
    assert IncrementalDetokenizer(smol, [])._stream is not None
    assert IncrementalDetokenizer(sentencepiece_like, [])._stream is None
    split = smol.encode("鬱")  # one character, three tokens of its bytes
    assert len(split) == 3
    ids = [*split, *smol.encode(" and "), *split[:-1]]  # the last character left incomplete
    pieces = stream(smol, ids)
    assert pieces[:3] == ["", "", "鬱"]  # held until the character is whole
    assert "".join(pieces) == smol.decode(ids) and pieces[-1] == "\ufffd"
