"""The frontend: what runs in the caller's process, on both sides of the engine core.

llm.py               ``LLM``: the offline batch API (add every prompt, step until all finish)
llm_engine.py        ``LLMEngine``: the frontend around an engine core, in this process or in
                     another (``core_client``); requests in, ``RequestOutput``s out
async_llm.py         ``AsyncLLM``: one engine driven by a background thread, many asyncio callers
input_processor.py   a prompt (text or ids) -> checked token ids, before anything is queued
output_processor.py  the core's token-id deltas -> text (incremental detokenizing), stop strings,
                     ``RequestOutput``s
core_client.py       the engine core in a process of its own, over ZMQ (``CoreClient``,
                     ``run_core``)
chat.py              conversations -> prompt ids through the model's chat template
stop_strings.py      stop strings in text that grows at its end
tokenizer.py         ``LLM.get_tokenizer()``: Hugging Face's tokenizer methods over the project's
recorder.py          ``trace_html``: a run's steps and KV pool as one HTML replay (replay.html)
"""
