"""A backend with no model: each row's next token is a fixed function of its last token and
position, returned at once. It measures the engine's host loop (``python -m engine.bench
--host-overhead``) and lets tests check the loop's bookkeeping against that function.

Not among the backends a config can name: the benchmark and the tests hand it to ``LLMEngine``
through ``backend_factory``. It holds no KV cache, so the swaps and copies only count pairs.

``device_step_s`` models a device: each step then takes that long on a device timeline of its own
(a step starts when the one before has ended), ``launch_greedy`` returns at once and its handle's
``result()`` sleeps until the step has ended, so async scheduling's overlap can be measured.
"""

from __future__ import annotations

import time

import numpy as np

from engine.backends.base import Backend, GreedyIds, block_pairs, resolve_kv_dtype, take_prev_ids
from engine.backends.forward_batch import ForwardBatch
from model_loader.config import ModelConfig

STUB_MEMORY_BYTES = 1 << 40  # what it reports as device memory: the pool is never allocated


def stub_next_token(last_token: np.ndarray, position: np.ndarray, vocab: int) -> np.ndarray:
    """The stub's model: (R,) last token ids and their positions -> (R,) next token ids, all
    ordinary ids in [100, vocab - 100) so the detokenizer sees real text."""
    span = vocab - 200
    nxt = (last_token.astype(np.int64) * 7919 + position.astype(np.int64) * 104729) % span
    return (nxt + 100).astype(np.int32)


class StubIds(GreedyIds):
    """Ids known at launch, handed over once the modelled device step has ended."""

    def __init__(self, ids: np.ndarray, ready_at: float):
        super().__init__(ids)
        self.ready_at = ready_at  # time.perf_counter() when the step ends

    def result(self) -> np.ndarray:
        wait = self.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self.ids


class StubBackend(Backend):
    """``StubBackend(model_config, engine_config, device_step_s=0.0)``: the ``Backend``
    interface, no arithmetic."""

    name = "stub"

    def __init__(self, model_config: ModelConfig, engine_config, device_step_s: float = 0.0):
        if engine_config.num_gpu_blocks is None:
            raise ValueError("StubBackend: num_gpu_blocks must be set (it has no memory to size)")
        self.cfg = model_config
        self.block_size = engine_config.block_size
        self.kv_dtype = resolve_kv_dtype(engine_config.dtype, model_config, on_gpu=False)
        self.num_blocks = 0
        self.blocks_moved = 0  # swapped or copied blocks, for the tests
        self.device_step_s = device_step_s
        self.device_free_at = 0.0  # time.perf_counter() when the modelled device is idle again

    @property
    def weights_bytes(self) -> int:
        return 0

    def total_memory_bytes(self) -> int:
        return STUB_MEMORY_BYTES

    def profile_peak_bytes(self, num_tokens: int, max_seq_len: int, num_seqs: int) -> int:
        return 0

    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        self.num_blocks = num_blocks

    def _move(self, pairs) -> None:
        self.blocks_moved += len(block_pairs(pairs)[0])

    def swap_out(self, pairs) -> None:
        self._move(pairs)

    def swap_in(self, pairs) -> None:
        self._move(pairs)

    def copy_blocks(self, pairs) -> None:
        self._move(pairs)

    def _ids(self, batch: ForwardBatch) -> np.ndarray:
        last = batch.output_rows  # (R,)
        return stub_next_token(batch.token_ids[last], batch.positions[last], self.cfg.vocab_size)

    def launch_greedy(self, batch: ForwardBatch, prev: GreedyIds | None = None) -> StubIds:
        """Returns at once; the previous step's ids are taken as a device would, unwaited."""
        if batch.prev_rows is not None:
            batch = take_prev_ids(batch, prev.ids)
        start = max(time.perf_counter(), self.device_free_at)
        self.device_free_at = start + self.device_step_s
        return StubIds(self._ids(batch), self.device_free_at)

    def forward_greedy(self, batch: ForwardBatch) -> np.ndarray:
        return self.launch_greedy(batch).result() if self.device_step_s else self._ids(batch)

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """(B, V) logits: 0 everywhere but 1 at the stub's token, so argmax picks it."""
        ids = self.forward_greedy(batch)  # (B,)
        logits = np.zeros((len(ids), self.cfg.vocab_size), dtype=np.float32)  # (B, V)
        logits[np.arange(len(ids)), ids] = 1.0
        return logits
