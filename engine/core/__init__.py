"""The engine core: one scheduled forward per step, from token ids in to token ids out.

engine_core.py   ``EngineCore``: the request book and the step loop (schedule -> execute ->
                 update -> outputs)
messages.py      what crosses between the frontend and the core (msgspec structs)
sequence.py      one sample of a request: its tokens, status, page table, stop checks
scheduler.py     continuous batching: who runs next step, with how many tokens; preemption
block_manager.py the KV block pool: free block queue, page tables, prefix caching
tier_prefix.py   the part of a waiting prompt's prefix that the KV tiers serve, per KV group
memory.py        how many KV blocks fit, planned before anything is allocated
model_runner.py  a scheduled step -> ``ForwardBatch`` -> the backend's forward -> sampled or
                 verified tokens (``RunnerOutput``)
sampler.py       penalties, bans, grammar masks, temperature / top-k / top-p / min-p draws
spec_step.py     speculative decoding around the loop: drafts before, verification after
async_step.py    async scheduling: a launched step read back one step later
spec_decode/     the draft proposers (n-gram lookup, a draft model) and acceptance rules
structured/      structured output through llguidance: grammars -> token masks
"""
