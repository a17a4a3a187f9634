"""LLM.chat: conversations through the model's chat template (the tiny model's is ChatML)."""

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
CONV = [
    {"role": "system", "content": "you are terse"},
    {"role": "user", "content": "hi my name is"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "hello there"},
]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_gpu_blocks=64, max_model_len=256)


def test_chat_is_generate_on_the_rendered_template(llm):
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "you are terse" in text
    want = llm.generate([tok.encode(text, add_special_tokens=False)], GREEDY, use_tqdm=False)
    got = llm.chat(CONV, GREEDY, use_tqdm=False)
    assert len(got) == 1 and got[0].token_ids == want[0].token_ids


def test_chat_takes_a_list_of_conversations(llm):
    convs = [CONV, CONV[1:2]]
    got = llm.chat(convs, GREEDY, use_tqdm=False)
    assert [g.token_ids for g in got] == [
        llm.chat(c, GREEDY, use_tqdm=False)[0].token_ids for c in convs
    ]


@pytest.mark.parametrize(
    "bad, message",
    [
        ([{"role": "wizard", "content": "x"}], "role"),
        ([{"role": "user", "content": 3}], "content"),
        ([CONV, []], "conversation 1"),
    ],
)
def test_bad_messages_are_value_errors(llm, bad, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(bad, GREEDY, use_tqdm=False)
