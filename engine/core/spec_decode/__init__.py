"""Speculative decoding: cheap guesses of the next few tokens, checked by one target forward.

config.py  ``SpeculativeConfig``: vLLM's ``speculative_config`` keys, checked at startup
draft_model.py  a smaller model's greedy guesses, over its own paged KV cache
ngram.py   prompt lookup: the tokens that followed the latest n-gram's earliest earlier match
verify.py  greedy acceptance: drafts kept while they equal the target's argmax, plus one;
           ``SpecStats``, the counters
"""

from engine.config.speculative import SpeculativeConfig, parse_speculative_config
from engine.core.spec_decode.draft_model import DraftModel
from engine.core.spec_decode.ngram import propose_ngram
from engine.core.spec_decode.verify import SpecStats, accept_greedy, accept_sampled

__all__ = [
    "DraftModel",
    "SpecStats",
    "SpeculativeConfig",
    "accept_greedy",
    "accept_sampled",
    "parse_speculative_config",
    "propose_ngram",
]
