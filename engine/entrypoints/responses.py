"""Engine outputs -> OpenAI response bodies and streamed chunks (``text_completion``,
``chat.completion``, ``chat.completion.chunk``).

A ``_Format`` is made per HTTP request. ``response(streams)`` awaits each request's last output
and builds one body; ``chunks(streams)`` turns outputs into chunks as they come (merged over the
request's prompts, choice ``index`` = prompt index * n + sample index), with usage per chunk
(``continuous_usage_stats``) and a last usage chunk (``include_usage``).

``CompletionFormat`` adds ``echo`` (the prompt's text, and with ``logprobs`` its tokens'
log-probabilities, before the generated ones; the first prompt token has none) and, with
``echo_only`` (``max_tokens: 0``), drops the one token the engine made. ``ChatFormat`` reads tool
calls back from the text (engine/entrypoints/tool_calls.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from engine.entrypoints.reasoning import ReasoningSplit, make_split
from engine.entrypoints.tool_calls import ToolMode, ToolStream
from engine.frontend.async_llm import RequestStream
from engine.outputs import CompletionOutput, RequestOutput

LENGTH = dict(finish_reason="length", stop_reason=None)


async def final_output(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    return last


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come; closing it aborts them all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised by the reader
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, out = await queue.get()
            if isinstance(out, Exception):
                raise out
            left -= out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


def _ending(c: CompletionOutput) -> dict:
    """How a choice ended: finish_reason, and vLLM's stop_reason (the stop string or token id)."""
    return dict(finish_reason=c.finish_reason, stop_reason=c.stop_reason)


def top_entries(lp: dict[int, float], token: int, k: int) -> list[tuple[int, float]]:
    """The k most likely of lp, and ``token`` (the one taken) if it is not among them."""
    top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
    if all(t != token for t, _ in top) and token in lp:
        top.append((token, lp[token]))
    return top


class _Format:
    """Shared by the two response shapes: usage, choice indices, streamed token counts."""

    def __init__(self, tokenizer, model: str, req):
        self.tokenizer, self.req, self.model = tokenizer, req, model
        self.created = int(time.time())
        self.id = uuid.uuid4().hex
        self.sent: dict[int, int] = {}  # choice index -> tokens already streamed

    ID_PREFIX: str  # the response id's prefix
    OBJECT: str  # "object" of a whole response
    CHUNK_OBJECT: str  # "object" of a streamed chunk

    def body(self, choices, usage, finals=None) -> dict:
        """A whole response: the envelope around its choices (``finals``: the requests' last
        outputs)."""
        return self._envelope(self.OBJECT, choices, usage)

    def chunk_body(self, choices, usage=None) -> dict:
        """One server-sent event's data."""
        return self._envelope(self.CHUNK_OBJECT, choices, usage)

    def _envelope(self, obj: str, choices, usage) -> dict:
        id_ = f"{self.ID_PREFIX}-{self.id}"
        created, model = self.created, self.model
        return dict(id=id_, object=obj, created=created, model=model, choices=choices, usage=usage)

    def index(self, prompt_index: int, c: CompletionOutput) -> int:
        return prompt_index * self.req.n + c.index

    def count(self, c: CompletionOutput) -> int:
        """The completion tokens of a choice, as usage counts them."""
        return len(c.token_ids)

    def usage(self, finals: list[RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        gen = sum(self.count(c) for o in finals for c in o.outputs)
        return dict(prompt_tokens=prompt, completion_tokens=gen, total_tokens=prompt + gen)

    def choice_usage(self, o: RequestOutput, c: CompletionOutput) -> dict:
        """One streamed choice's usage so far (continuous_usage_stats)."""
        prompt, gen = len(o.prompt_token_ids), self.count(c)
        return dict(prompt_tokens=prompt, completion_tokens=gen, total_tokens=prompt + gen)

    def new_tokens(self, index: int, c: CompletionOutput) -> tuple[list[int], list[dict]]:
        """The token ids (and their logprobs) of this choice not yet streamed."""
        start = self.sent.get(index, 0)
        self.sent[index] = len(c.token_ids)
        return c.token_ids[start:], (c.logprobs or [])[start:]

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def prompt_logprobs(self, o: RequestOutput) -> list | None:
        """vLLM's ``prompt_logprobs``: None for the first token, then {token id: {logprob,
        decoded_token}} per prompt token (its own and the top N)."""
        if o.prompt_logprobs is None:
            return None
        return [
            None
            if lp is None
            else {
                str(t): {"logprob": v, "decoded_token": self.token_text(t)}
                for t, v in sorted(lp.items(), key=lambda kv: -kv[1])
            }
            for lp in o.prompt_logprobs
        ]

    async def response(self, streams: list[RequestStream]) -> dict:
        finals = await asyncio.gather(*[final_output(s) for s in streams])
        choices = [self.choice(i, o, c) for i, o in enumerate(finals) for c in o.outputs]
        return self.body(choices, self.usage(finals), finals)

    async def chunks(self, streams: list[RequestStream]) -> AsyncIterator[dict]:
        finals: dict[int, RequestOutput] = {}
        async for i, out in merged(streams):
            if out.finished:
                finals[i] = out
            for c in out.outputs:
                chunk = self.delta_choice(i, out, c)
                if chunk is not None:
                    usage = self.choice_usage(out, c) if self.req.continuous_usage else None
                    yield self.chunk_body([chunk], usage)
        if self.req.include_usage:
            yield self.chunk_body([], self.usage(list(finals.values())))


class CompletionFormat(_Format):
    """``text_completion`` bodies and chunks. ``prompt_texts``: each prompt's text (given, or its
    token ids decoded), for ``echo``; ``echo_only``: ``max_tokens`` was 0, so the one token the
    engine generated is dropped and the choice is the prompt alone, finished by "length"."""

    ID_PREFIX, OBJECT, CHUNK_OBJECT = "cmpl", "text_completion", "text_completion"

    def __init__(self, tokenizer, model, req, prompt_texts=None, echo_only=False):
        super().__init__(tokenizer, model, req)
        self.prompt_texts, self.echo_only = prompt_texts, echo_only

    def count(self, c: CompletionOutput) -> int:
        return 0 if self.echo_only else len(c.token_ids)

    def logprobs(self, ids: list[int], lps: list, offset: int) -> dict | None:
        """OpenAI's completion logprobs; an entry of lps that is None (the first prompt token)
        has a null logprob and null top_logprobs."""
        k = self.req.logprobs
        if k is None:
            return None
        tokens = [self.token_text(t) for t in ids]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        pairs = zip(ids, lps, strict=True)
        top = [None if lp is None else self.top_dict(lp, tid, k) for tid, lp in pairs]
        return dict(
            tokens=tokens,
            token_logprobs=[None if lp is None else lp[t] for t, lp in zip(ids, lps, strict=True)],
            top_logprobs=top,
            text_offset=offsets,
        )

    def top_dict(self, lp: dict[int, float], token: int, k: int) -> dict[str, float]:
        """{token text: logprob} of the top k and the token taken; where two tokens have the
        same text (bytes of one character decode to U+FFFD each) the more likely is kept."""
        out: dict[str, float] = {}
        for t, v in top_entries(lp, token, k):
            out.setdefault(self.token_text(t), v)
        return out

    def generated(self, c: CompletionOutput, ids, lps, text: str):
        """(ids, logprobs, text, ending) of the generated part: none of it with echo_only."""
        if self.echo_only:
            return [], [], "", LENGTH
        return ids, lps, text, _ending(c)

    def with_prompt(self, i: int, o: RequestOutput, ids, lps, text: str):
        """The generated ids, logprobs and text with the prompt's in front (echo)."""
        prompt = o.prompt_token_ids
        prompt_lps = o.prompt_logprobs or [None] * len(prompt)
        return [*prompt, *ids], [*prompt_lps, *lps], self.prompt_texts[i] + text

    def choice(self, i: int, o: RequestOutput, c: CompletionOutput) -> dict:
        ids, lps, text, ending = self.generated(c, c.token_ids, c.logprobs or [], c.text)
        if self.prompt_texts is not None:
            ids, lps, text = self.with_prompt(i, o, ids, lps, text)
        out = dict(index=self.index(i, c), text=text, logprobs=self.logprobs(ids, lps, 0), **ending)
        if self.req.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs(o)
        return out

    def delta_choice(self, i: int, o: RequestOutput, c: CompletionOutput) -> dict | None:
        index = self.index(i, c)
        if self.echo_only and not c.finished:
            return None  # one chunk, at the end, with the prompt alone
        first = index not in self.sent
        ids, lps = self.new_tokens(index, c)
        ids, lps, delta, ending = self.generated(c, ids, lps, c.text_delta)
        echo = first and self.prompt_texts is not None
        if not echo and not delta and not ids and ending["finish_reason"] is None:
            return None
        if echo:
            ids, lps, delta = self.with_prompt(i, o, ids, lps, delta)
            offset = 0
        else:
            offset = len(c.text) - len(c.text_delta)
            if self.prompt_texts is not None:
                offset += len(self.prompt_texts[i])
        logprobs = self.logprobs(ids, lps, offset)
        return dict(index=index, text=delta, logprobs=logprobs, **ending)


class ChatFormat(_Format):
    """``chat.completion`` bodies and ``chat.completion.chunk`` chunks; ``mode``: how tool calls
    are read back from each choice's text."""

    ID_PREFIX, OBJECT, CHUNK_OBJECT = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, tokenizer, model, req, mode: ToolMode, reasoning=None):
        """``reasoning``: (parser, whether the prompt opened the thinking) with a reasoning
        parser (engine/entrypoints/reasoning.py): the thinking is ``reasoning_content``, tool
        calls and content are read from the answer after it."""
        super().__init__(tokenizer, model, req)
        self.mode = mode
        self.reasoning = reasoning
        self.tool_streams: dict[int, ToolStream] = {}  # choice index -> its stream parser
        self.splits: dict[int, ReasoningSplit] = {}  # choice index -> its thinking / answer

    def body(self, choices, usage, finals=None) -> dict:
        out = super().body(choices, usage)
        if self.req.prompt_logprobs is not None and finals:
            out["prompt_logprobs"] = self.prompt_logprobs(finals[0])
        return out

    def logprobs(self, ids: list[int], lps: list[dict]) -> dict | None:
        if not self.req.logprobs:
            return None
        content = []
        for t, lp in zip(ids, lps, strict=True):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[: self.req.top_logprobs or 0]
            content.append(self.entry(t, lp[t]) | {"top_logprobs": [self.entry(*kv) for kv in top]})
        return {"content": content}

    def entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return dict(token=text, logprob=logprob, bytes=list(text.encode()))

    @staticmethod
    def ending(c: CompletionOutput, called: bool) -> dict:
        """finish_reason "tool_calls" for a choice that called tools and was not cut short."""
        ending = _ending(c)
        if called and c.finish_reason == "stop":
            ending["finish_reason"] = "tool_calls"
        return ending

    def choice(self, i: int, o: RequestOutput, c: CompletionOutput) -> dict:
        thinking, answer = None, c.text
        if self.reasoning is not None:
            thinking, answer = make_split(*self.reasoning).split(c.text)
        content, calls = self.mode.parse(answer or "")
        message = {"role": "assistant", "content": content or None if thinking else content}
        if thinking is not None:
            message["reasoning_content"] = thinking
        if calls:
            message["tool_calls"] = calls
        lps = self.logprobs(c.token_ids, c.logprobs or [])
        index = self.index(i, c)
        return dict(index=index, message=message, logprobs=lps, **self.ending(c, bool(calls)))

    def delta_choice(self, i: int, o: RequestOutput, c: CompletionOutput) -> dict | None:
        index = self.index(i, c)
        first = index not in self.sent
        ids, lps = self.new_tokens(index, c)
        if not first and not c.text_delta and not ids and c.finish_reason is None:
            return None
        tools = self.tool_streams.setdefault(index, ToolStream(self.mode))
        text, thinking = c.text_delta, ""
        if self.reasoning is not None:
            split = self.splits.setdefault(index, make_split(*self.reasoning))
            thinking, text = split.feed(c.text_delta, c.finished)
        content, calls = tools.delta(text, c.finished)
        delta = {"role": "assistant"} if first else {}
        if thinking:
            delta["reasoning_content"] = thinking
        send = content is not None if self.reasoning is None else bool(content)
        if (first and not thinking) or send:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        logprobs = self.logprobs(ids, lps)
        return dict(index=index, delta=delta, logprobs=logprobs, **self.ending(c, tools.calls > 0))
