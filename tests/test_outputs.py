"""What CompletionOutput derives from what the engine recorded."""

import math

from engine.frontend.llm import run_to_completion
from engine.sampling_params import SamplingParams
from tests.utils import make_engine


def test_cumulative_logprob_sums_the_sampled_tokens(tiny):
    with_lp = SamplingParams(temperature=0.7, seed=3, max_tokens=6, logprobs=1)
    out = run_to_completion(make_engine(tiny), ["hello there"], with_lp)[0].outputs[0]
    want = sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs, strict=True))
    assert math.isclose(out.cumulative_logprob, want) and out.cumulative_logprob < 0
    plain = SamplingParams(temperature=0, max_tokens=3)
    assert (
        run_to_completion(make_engine(tiny), ["hi"], plain)[0].outputs[0].cumulative_logprob is None
    )
