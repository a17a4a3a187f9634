"""One sequence: its token ids, status, page table and how many of its tokens are cached; made
whole by its constructor (the sample index, RNG, stop ids, bad words and length limit the
engine core gives each of a request's samples)."""

from __future__ import annotations

import enum
import itertools
import time

from engine.core.sampler import always_plain_greedy
from engine.sampling_params import SamplingParams

_seq_ids = itertools.count()


def model_eos_ids(loaded) -> list[int]:
    """The ids that end a sequence of a LoadedModel: its config's, else its tokenizer's."""
    return list(loaded.config.eos_token_ids or loaded.tokenizer.eos_token_ids)


# async scheduling: the last token of a sequence whose step is launched but not yet read back
PENDING_TOKEN = -2


# an adapter's hash-chain root: ints only, so the same in every process (a str's hash is not)
LORA_ROOT = 0x4C6F5241


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # in the waiting queue: nothing (or nothing any more) in the cache
    RUNNING = enum.auto()  # owns GPU blocks, scheduled every step
    SWAPPED = enum.auto()  # preempted by swap: its blocks live in the CPU pool
    FINISHED = enum.auto()  # stopped, aborted or rejected; owns no blocks


class Sequence:
    """A prompt and its growing output, with the bookkeeping the scheduler and block manager need.

    ``num_computed_tokens`` counts the tokens whose K/V are in the cache; the tokens still to run
    through the model are ``token_ids[num_computed_tokens:]`` (the whole prompt at arrival, one
    token while decoding, prompt + output again after a recompute preemption).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        *,
        index: int = 0,
        generator=None,
        stop_ids: frozenset[int] = frozenset(),
        bad_words_ids: list[list[int]] | None = None,
        max_model_len: int | None = None,
        lora_id: int | None = None,
    ):
        self.seq_id = next(_seq_ids)
        # LoRA: its adapter's id (None: the base model), the slot it runs in once admitted, and
        # the root of its blocks' hash chain, so no adapter's prefix is another's
        self.lora_id = lora_id
        self.lora_slot: int | None = None
        self.hash_root: int | None = None if lora_id is None else hash((LORA_ROOT, lora_id))
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # prompt + output, kept in step with append_token (read every step: never rebuilt)
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = self.num_tokens
        self.last_token_id = self.token_ids[-1] if self.token_ids else None
        self.params = params if params is not None else SamplingParams()
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []  # GPU block ids, in token order
        self.cpu_block_table: list[int] = []  # CPU block ids while SWAPPED
        # KV groups (a model whose layers attend differently): block_table is group 0's, these
        # the other groups' page tables, as long ([] with one group); CPU ones while SWAPPED
        self.group_tables: list[list[int]] = []
        self.cpu_group_tables: list[list[int]] = []
        self.num_computed_tokens = 0
        # prefix caching: the chained hashes of its full blocks of tokens (filled lazily), how
        # many of block_table's blocks are registered or reused from the cache, and how many
        # prompt tokens its first admission found cached (vLLM's num_cached_tokens)
        self.block_hashes: list[int] = []
        self.num_cached_blocks = 0
        self.num_cached_tokens: int | None = None
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | None = None  # the stop token id that ended it
        self.error: str | None = None  # why it was aborted (a refused token, a failed sample)
        # the engine core's: which of the request's samples, its RNG, and what the frontend has
        # been sent (output tokens so far; the logprobs and logits rows of the tokens since)
        self.index = index
        self.generator = generator
        self.num_sent = 0
        self.new_logprobs: list[dict[int, float]] = []
        self.new_logits: list = []
        self.prompt_logprobs_sent = False
        # the stop checks: the ids that end it (EOS unless ignored, stop_token_ids) and its
        # length limit, resolved here once (prompt + max_tokens, at most max_model_len)
        self.stop_ids = stop_ids
        self.max_num_tokens = self.num_tokens + self.params.max_tokens
        if max_model_len is not None:
            self.max_num_tokens = min(self.max_num_tokens, max_model_len)
        self.always_plain = always_plain_greedy(self.params)  # every row an argmax of raw logits
        # the sampler's per-request rules beyond SamplingParams: bad words as token ids, and
        # the grammar state of a structured-output request (engine/core/structured/matcher.py)
        self.bad_words_ids: list[list[int]] = bad_words_ids or []
        self.matcher = None
        # prompt_logprobs: one entry per prompt token computed so far (the first is None)
        self.prompt_logprobs: list[dict[int, float] | None] = []

    @classmethod
    def of_request(cls, req, index: int, generator, stop_ids, max_model_len: int) -> Sequence:
        """Sample ``index`` of a CoreRequest, with its RNG, stop ids and length limit."""
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.params,
            req.arrival_time,
            index=index,
            generator=generator,
            stop_ids=stop_ids,
            bad_words_ids=req.bad_words_ids,
            max_model_len=max_model_len,
            lora_id=None if req.lora_request is None else req.lora_request.lora_int_id,
        )

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, {self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table})"
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens not yet in the cache: what the next prefill (or decode) has to run."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        token_id = int(token_id)
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        self.num_tokens += 1
        self.last_token_id = token_id

    def resolve_pending(self, token_id: int) -> None:
        """Async scheduling: the id the step produced, in place of the PENDING_TOKEN last."""
        assert self.last_token_id == PENDING_TOKEN, f"{self} has no pending token"
        token_id = int(token_id)
        self.output_token_ids[-1] = self.token_ids[-1] = self.last_token_id = token_id

    def drop_pending(self) -> None:
        """Async scheduling: the step produced no token (a failed sample): forget the slot."""
        assert self.last_token_id == PENDING_TOKEN, f"{self} has no pending token"
        self.output_token_ids.pop()
        self.token_ids.pop()
        self.num_tokens -= 1
        self.last_token_id = self.token_ids[-1] if self.token_ids else None

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep the first ``num_output_tokens`` output tokens (a finished sequence whose
        frontend found a stop string before its last tokens)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[num_output_tokens:], self.token_ids[-drop:]
            self.num_tokens -= drop
            self.last_token_id = self.token_ids[-1] if self.token_ids else None

    def check_stop(self, eos_token_ids) -> str | None:
        """Why the last token ends it, or None: a finished grammar; EOS or a stop token id once
        min_tokens are out (the token id is ``stop_reason``, set here; EOS comes first); else
        the length limit (max_tokens, max_model_len). Stop strings are the frontend's."""
        if self.matcher is not None and self.matcher.is_stopped():
            return "stop"  # its grammar is complete: nothing but EOS could follow
        token, p = self.last_token_id, self.params
        if token in self.stop_ids and self.num_output_tokens >= p.min_tokens:
            if p.ignore_eos or token not in eos_token_ids:
                self.stop_reason = token
            return "stop"
        if self.num_tokens >= self.max_num_tokens:
            return "length"
        return None
