"""stop_reason, include_stop_str_in_output and skip_special_tokens, in the text and the stream."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.core.messages import SampleDelta
from engine.frontend.llm import run_to_completion
from engine.frontend.output_processor import OutputProcessor
from tests.utils import SEED_PROMPTS, make_engine, with_eos

PROMPT = SEED_PROMPTS[0]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 24, "ignore_eos": True, **kw})


def _run(engine, params):
    (out,) = run_to_completion(engine, [PROMPT], params)
    return out.outputs[0]


def _stop_string(text: str) -> str:
    """Two characters from the middle of text, with no partial character in them."""
    at = next(i for i in range(len(text) // 2, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    return text[at : at + 2]


def test_stop_reason_names_the_stop_token_id_or_string(tiny):
    engine = make_engine(tiny)
    full = _run(engine, _greedy())
    assert (full.finish_reason, full.stop_reason) == ("length", None)
    stop_id = full.token_ids[5]
    o = _run(engine, _greedy(stop_token_ids=[stop_id]))
    assert (o.finish_reason, o.stop_reason) == ("stop", stop_id)
    assert isinstance(o.stop_reason, int)
    stop = _stop_string(full.text)
    o = _run(engine, _greedy(stop=["\x00never", stop]))
    assert (o.finish_reason, o.stop_reason) == ("stop", stop)


def test_eos_has_no_stop_reason(tiny):
    engine = make_engine(tiny)
    full = _run(engine, _greedy())
    eos = full.token_ids[3]
    engine = make_engine(with_eos(tiny, eos))
    o = _run(engine, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[eos]))
    assert (o.finish_reason, o.stop_reason) == ("stop", None)  # EOS first, as in vLLM


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output_in_text_and_stream(tiny, include):
    engine = make_engine(tiny)
    full = _run(engine, _greedy()).text
    stop = _stop_string(full)
    end = full.index(stop) + (len(stop) if include else 0)
    params = _greedy(stop=[stop], include_stop_str_in_output=include)
    assert _run(engine, params).text == full[:end]
    chunks = list(engine.stream(PROMPT, params))
    assert "".join(c.text for c in chunks) == full[:end]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == stop


def _processor(tok, params: SamplingParams, ids: list[int]) -> list:
    """Feed ids one by one through an OutputProcessor, as the core's deltas (the last one
    ending the sample by length); every output of the request."""
    op = OutputProcessor(tok)
    op.add_request("r", None, [5, 6], params, 0.0)
    outs = []
    for k, token in enumerate(ids):
        end = "length" if k == len(ids) - 1 else None
        op.process([SampleDelta("r", 0, [token], finish_reason=end)], 1.0)
        outs += op.outputs()
    return outs


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_in_text_and_deltas(tiny, skip):
    tok = tiny.tokenizer
    words = tok.encode("hello there", add_special_tokens=False)
    special = sorted(tok.special_token_ids)[0]
    ids = [*words[:1], special, *words[1:]]
    params = SamplingParams(max_tokens=len(ids), skip_special_tokens=skip)
    outs = _processor(tok, params, ids)
    want = tok.decode(ids, skip_special_tokens=skip)
    assert outs[-1].outputs[0].text == want
    assert "".join(o.outputs[0].text_delta for o in outs) == want
    assert (tok.id_to_token(special) in want) is not skip


@pytest.mark.parametrize("field", ["include_stop_str_in_output", "skip_special_tokens"])
def test_bool_fields_reject_non_bools(field):
    with pytest.raises(ValueError, match=rf"^SamplingParams: {field} must be True or False"):
        SamplingParams(**{field: 1})
