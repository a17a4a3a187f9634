"""The sampler's rules beyond temperature and penalties, through the engine: logit_bias,
allowed_token_ids, bad_words and structured output (a grammar the output must match).

Oracles: the reference forward (the tokens a rule must pick), Python's ``json`` and ``re`` (the
text a grammar must give), and the same requests without the rule beside them (unconstrained
requests keep their tokens in a mixed batch).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from engine import SamplingParams
from engine.core.sampler import bad_word_bans
from engine.core.structured import StructuredOutputsParams
from engine.frontend.llm import run_to_completion
from reference.model import forward
from tests.test_structured import PERSON, check_schema
from tests.utils import make_engine

GREEDY = dict(temperature=0.0, ignore_eos=True)


def greedy_tokens(loaded, prompt, n, rule=lambda logits, out: logits):
    """n greedy tokens by the reference forward, each step's logits edited by ``rule``."""
    ids, out = list(prompt), []
    for _ in range(n):
        logits = rule(forward(loaded.weights, loaded.config, ids).astype(np.float64), out)
        out.append(int(np.argmax(logits)))
        ids.append(out[-1])
    return out


def test_logit_bias_bans_and_forces(tiny):
    rng = np.random.default_rng()
    prompt = rng.integers(3, 320, 8).tolist()
    engine = make_engine(tiny, backend="numpy")
    (plain,) = run_to_completion(engine, [prompt], SamplingParams(max_tokens=6, **GREEDY))
    forced = int(rng.integers(3, 320))
    banned = plain.token_ids[0]
    params = [
        SamplingParams(max_tokens=6, logit_bias={forced: 100.0}, **GREEDY),
        SamplingParams(max_tokens=6, logit_bias={str(banned): -100}, **GREEDY),  # JSON keys
    ]
    up, down = run_to_completion(engine, [prompt, prompt], params)
    assert up.token_ids == [forced] * 6

    def ban(logits, out):
        logits[banned] -= 100.0
        return logits

    assert down.token_ids == greedy_tokens(tiny, prompt, 6, ban)
    assert banned not in down.token_ids[:1]


def test_allowed_token_ids_pick_the_best_allowed(tiny):
    rng = np.random.default_rng()
    prompt = rng.integers(3, 320, 8).tolist()
    allowed = sorted(rng.choice(np.arange(3, 320), 12, replace=False).tolist())
    params = SamplingParams(max_tokens=8, allowed_token_ids=allowed, **GREEDY)
    (out,) = run_to_completion(make_engine(tiny, backend="numpy"), [prompt], params)

    def only(logits, _):
        keep = np.full_like(logits, -np.inf)
        keep[allowed] = logits[allowed]
        return keep

    assert out.token_ids == greedy_tokens(tiny, prompt, 8, only)
    sampled = SamplingParams(max_tokens=30, allowed_token_ids=allowed, temperature=1.5, seed=3)
    (hot,) = run_to_completion(make_engine(tiny, backend="numpy"), [prompt], sampled)
    assert set(hot.token_ids) <= set(allowed)


def test_bad_word_bans_follow_the_output():
    assert bad_word_bans([5, 6, 7], [[9]]) == [9]  # one token: always
    assert bad_word_bans([5, 6, 7], [[6, 7, 8], [7, 4], [5, 4]]) == [8, 4]
    assert bad_word_bans([], [[6, 7], [3]]) == [3]


def test_bad_words_never_appear(tiny):
    """A phrase greedy decoding produces is banned: it never appears in the output again, as
    tokens alone or after a space."""
    rng = np.random.default_rng()
    engine = make_engine(tiny, backend="numpy")
    prompt = rng.integers(3, 320, 8).tolist()
    (plain,) = run_to_completion(engine, [prompt], SamplingParams(max_tokens=12, **GREEDY))
    word = tiny.tokenizer.decode(plain.token_ids[2:4]).strip() or "hello"
    params = SamplingParams(max_tokens=12, bad_words=[word], **GREEDY)
    (out,) = run_to_completion(engine, [prompt], params)
    bites = len(plain.token_ids)  # where greedy decoding first meets a banned spelling's end
    for spelling in (word, " " + word):
        ids = tiny.tokenizer.encode(spelling, add_special_tokens=False)
        n = len(ids)
        assert all(out.token_ids[i : i + n] != ids for i in range(len(out.token_ids)))
        hits = [i + n - 1 for i in range(len(plain.token_ids)) if plain.token_ids[i : i + n] == ids]
        bites = min([bites, *hits])
    assert out.token_ids[:bites] == plain.token_ids[:bites]  # the same until the ban bites


def json_params(**kw):
    schema = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    return SamplingParams(max_tokens=100, structured_outputs=schema, **kw)


def test_structured_outputs_through_the_engine(smollm2):
    """JSON schema (greedy, and sampled with n=2), regex and choice on SmolLM2: every output
    parses and matches, ends with 'stop' when its grammar completes, and the unconstrained
    request in the same batch keeps the tokens it has alone."""
    engine = make_engine(smollm2, backend="numpy", max_model_len=512, num_gpu_blocks=128)
    free = SamplingParams(temperature=0.0, max_tokens=8)
    (alone,) = run_to_completion(engine, ["The capital of France is"], free)
    prompts = ["A user record as JSON:", "Two people as JSON:", "Call me at", "Pick one:"]
    prompts.append("The capital of France is")
    params = [
        json_params(temperature=0.0),
        json_params(temperature=0.7, n=2, seed=11),
        SamplingParams(
            max_tokens=12, structured_outputs=StructuredOutputsParams(regex=r"\d{3}-\d{4}")
        ),
        SamplingParams(
            temperature=0.7,
            max_tokens=6,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]),
        ),
        free,
    ]
    outs = run_to_completion(engine, prompts, params, check_invariants=True)
    samples = [c for o in outs for c in o.outputs]  # the greedy JSON, two sampled ones, ...
    for c in samples[:3]:
        assert c.finish_reason == "stop", c.text
        check_schema(json.loads(c.text), PERSON)
    assert re.fullmatch(r"\d{3}-\d{4}", samples[3].text) and samples[3].finish_reason == "stop"
    assert samples[4].text in ("yes", "no", "maybe")
    assert samples[5].token_ids == alone.token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bad_constraints_and_ids_are_refused_and_the_engine_serves_on(tiny):
    engine = make_engine(tiny, backend="numpy")
    bad = [
        (SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9")), "regex"),
        (
            SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "objectx"})),
            "json",
        ),
        (SamplingParams(logit_bias={999: 1.0}), "logit_bias has token id 999"),
        (SamplingParams(allowed_token_ids=[5, 320]), "allowed_token_ids has token id 320"),
    ]
    for i, (params, words) in enumerate(bad):
        with pytest.raises(ValueError, match=re.escape(words)):
            engine.add_request(f"bad{i}", "hi there", params)
    (ok,) = run_to_completion(engine, ["hi there"], SamplingParams(max_tokens=4, **GREEDY))
    assert len(ok.token_ids) == 4
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(logit_bias={5: 101}), "a bias in [-100, 100]"),
        (dict(logit_bias={-1: 1}), "keyed by non-negative token ids"),
        (dict(logit_bias=[1, 2]), "a dict of token id -> bias"),
        (dict(allowed_token_ids=[]), "a non-empty list"),
        (dict(bad_words="word"), "a list of non-empty strings"),
        (dict(structured_outputs={"regex": "a"}), "a StructuredOutputsParams"),
    ],
)
def test_sampling_params_refusals(kw, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        SamplingParams(**kw)


def test_structured_requests_beside_speculation(tiny):
    """With n-gram speculation on, a constrained request decodes plainly (its grammar is fed
    one token at a time) and matches; the free ones still speculate."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    engine = make_engine(tiny, backend="numpy", speculative_config=spec)
    rng = np.random.default_rng()
    phrase = rng.integers(3, 320, 5).tolist()
    regex = StructuredOutputsParams(regex="(ab|cd){2,6}")
    params = [
        SamplingParams(max_tokens=40, structured_outputs=regex, temperature=0.0),
        SamplingParams(max_tokens=40, **GREEDY),
    ]
    outs = run_to_completion(engine, [phrase * 3, phrase * 3], params, check_invariants=True)
    assert re.fullmatch("(ab|cd){2,6}", outs[0].text), outs[0].text
    assert engine.spec_stats.num_drafts > 0


@pytest.mark.parametrize(
    "args",
    [
        dict(backend="numpy"),
        dict(backend="cuda-cpu"),
        dict(
            backend="numpy", enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4
        ),
        dict(backend="numpy", enable_prefix_caching=True),
        dict(backend="numpy", speculative_config='{"method": "ngram", "prompt_lookup_min": 1}'),
        dict(backend="numpy", num_gpu_blocks=20, block_size=4, max_model_len=64),  # preempts
    ],
    ids=["numpy", "cuda-cpu", "chunked", "prefix-cache", "speculation", "preemption"],
)
def test_prompt_logprobs_equal_the_reference(tiny, args):
    """Each prompt token's log-probability given the tokens before it (the first has none),
    and the top-N around it, equal the reference forward's, however the prompt was run."""
    from engine.core.sampler import log_softmax

    rng = np.random.default_rng()
    prompts = [rng.integers(3, 320, int(rng.integers(20, 40))).tolist() for _ in range(4)]
    prompts[1] = prompts[0][:24]  # a shared prefix (cached with prefix caching on)
    params = SamplingParams(max_tokens=20, prompt_logprobs=3, **GREEDY)
    free = SamplingParams(max_tokens=20, **GREEDY)
    engine = make_engine(tiny, **args)
    outs = run_to_completion(engine, prompts + prompts[:2], [params] * 4 + [free] * 2)
    for prompt, o in zip(prompts, outs, strict=False):
        assert len(o.prompt_logprobs) == len(prompt) and o.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            lp = log_softmax(forward(tiny.weights, tiny.config, prompt[:j]).astype(np.float32))
            top = np.argsort(-lp, kind="stable")[:3].tolist()
            got = o.prompt_logprobs[j]
            assert set(got) == set(top) | {prompt[j]}
            for t, v in got.items():
                assert abs(v - lp[t]) < 1e-4, (j, t, v, lp[t])
    assert all(o.prompt_logprobs is None for o in outs[4:])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
