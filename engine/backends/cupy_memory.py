"""The GPU backend's memory accounting: the weights' bytes (GGUF blocks as stored, logged by
format at startup), a step's activation bytes (computed, with the tile that a batch of more
than eight rows widens a kept matrix into, and on a GPU measured by a profile forward), the
CUDA graphs' pool; what ``plan_kv_cache``
(engine/core/memory.py) sizes the pool from. ``DeviceMemory`` is a part of ``CupyBackend``
(its device, config, kernels and ``_run_eager``).
"""

from __future__ import annotations

import logging

import numpy as np

from engine.backends.cupy_blocks import DeviceBlocks, bytes_by_format
from engine.backends.cupy_moe import step_bytes as experts_step_bytes
from engine.backends.cupy_step import on_device
from engine.backends.forward_batch import ForwardBatch
from engine.kernels.gguf_launch import GGUF_MATVEC_MAX_BATCH
from engine.kernels.launch import LORA_MAX_SPLITS, lora_max_tiles
from engine.utils import MiB, cdiv

log = logging.getLogger("engine.backend")


class DeviceMemory:
    def _weight_arrays(self) -> list:
        """Every weight on the device once: arrays, and matrices kept in GGUF blocks."""
        arrays = [self.embed, self.final_norm]
        arrays += [a for lw in self.layers for a in vars(lw).values() if a is not None]
        return arrays + ([] if self.lm_head is self.embed else [self.lm_head])

    @property
    def weights_bytes(self) -> int:
        """The weights' bytes on the device (GGUF blocks as stored), the LoRA slots' included."""
        arrays = self._weight_arrays()
        arrays += [a for layer in self.lora_layers for pair in layer.values() for a in pair]
        return sum(int(a.nbytes) for a in arrays)

    def _log_formats(self) -> None:
        kinds = sorted(bytes_by_format(self._weight_arrays()).items(), key=lambda kv: -kv[1])
        log.info(
            "weights resident, by format: %s",
            ", ".join(f"{kind} {n / MiB:.1f} MiB" for kind, n in kinds),
        )

    def _tile_bytes(self, T: int) -> int:
        """The widest tile a product of T rows widens a matrix kept in blocks into (none for
        up to GGUF_MATVEC_MAX_BATCH rows: the kernel reads the blocks as they are)."""
        if T <= GGUF_MATVEC_MAX_BATCH:
            return 0
        e = self.dtype.itemsize
        arrays = self._weight_arrays()
        arrays += [m for a in arrays for m in getattr(a, "shared", None) or ()]  # experts'
        kept = [a for a in arrays if isinstance(a, DeviceBlocks)]
        return max((a.tile_bytes(e) for a in kept), default=0)

    def total_memory_bytes(self) -> int:
        """The device's memory (the budget is this times gpu_memory_utilization)."""
        return self.device.total_memory_bytes()

    def _partitions(self, max_context_len: int, B: int) -> int:
        """Decode partitions per sequence to budget for a batch of up to ``B`` sequences: fewer
        sequences get more partitions each (the split fills the SMs), so this covers the most
        partial rows (b sequences x their partitions, when over one) that any b <= B asks for;
        1 when no such batch splits its contexts."""
        H, Hkv = self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        B = max(1, B)
        rows = 0
        for b in set(range(1, min(B, self.k.sm_count) + 1)) | {B}:
            P = self.k.decode_split(max_context_len, b, H, Hkv, self.split_window)[0]
            rows = max(rows, b * P if P > 1 else 0)
        return max(2, cdiv(rows, B)) if rows else 1

    def step_bytes(
        self, T: int, B: int, partitions: int, layers_with_partials: int = 1, lora: bool = True
    ) -> int:
        """Device bytes one step allocates: inputs, workspace, logits, attention partials (the
        decode kernel's per-layer scratch, held by ``layers_with_partials`` layers at once),
        with ``lora`` (steps with LoRA rows: never a graph's) the tiles and the shrink's float32
        partials (the widest: q|k|v's)."""
        c, e = self.cfg, self.dtype.itemsize
        extra = 0
        if lora and self.lora_shape is not None:
            S, R = self.lora_shape
            extra = 4 * (T + 3 * lora_max_tiles(T, S)) + LORA_MAX_SPLITS * T * 3 * R * 4 + 1024
        M = cdiv(self.max_model_len, self.block_size)
        inputs = 4 * (4 * T + 3 * B + 1 + B * M)
        per_token = 3 * c.hidden_size + 3 * c.q_dim + 2 * c.kv_dim + 3 * c.intermediate_size
        last = B * 3 * c.hidden_size * e + B * c.vocab_size * 4
        partials = B * c.num_attention_heads * partitions * (c.head_dim + 2) * 4
        partials = partials if partitions > 1 else 0
        pool_rounding = 512 * (16 + 2 * layers_with_partials)  # CuPy rounds each block
        step = inputs + T * per_token * e + last + layers_with_partials * partials + pool_rounding
        if c.moe is not None:  # a layer of experts' pairs (engine/backends/cupy_moe.py)
            step += experts_step_bytes(c.moe, T, c.hidden_size, e)
        return step + extra + self._tile_bytes(T)

    def graph_pool_estimate(self) -> int:
        """The graphs share one pool sized by the largest capture (every layer's partials live)."""
        if not self.use_graphs:
            return 0
        B = self.max_graph_batch
        P = self._partitions(self.max_model_len, B)
        return self.step_bytes(B, B, P, self.cfg.num_hidden_layers, lora=False)

    @on_device
    def profile_peak_bytes(self, num_tokens: int, max_seq_len: int, num_seqs: int) -> int:
        """Activation peak of a step of ``num_tokens`` tokens (computed; on a GPU also measured by
        a profile forward, the larger kept) plus the CUDA graphs' pool."""
        B = min(num_seqs, num_tokens)
        computed = self.step_bytes(num_tokens, B, self._partitions(max_seq_len, B))
        measured = None
        if self.device.profiles_memory:
            measured = self.device.measure_peak(
                lambda: self._profile_forward(num_tokens, max_seq_len)
            )
        graphs = self.graph_pool_estimate()
        log.info(
            "profile forward of %d tokens: activation peak %.1f MiB computed, %s measured; "
            "CUDA graph pool %.1f MiB (estimate)",
            num_tokens,
            computed / MiB,
            "not" if measured is None else f"{measured / MiB:.1f} MiB",
            graphs / MiB,
        )
        return max(computed, measured or 0) + graphs

    def _profile_forward(self, num_tokens: int, max_seq_len: int) -> None:
        """A forward of prefills filling ``num_tokens``, on a scratch cache (no KV written)."""
        bs = self.block_size
        lens = [max_seq_len] * (num_tokens // max_seq_len)
        lens += [num_tokens % max_seq_len] if num_tokens % max_seq_len else []
        n_blocks = cdiv(max(lens), bs)
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)  # (B+1,)
        batch = ForwardBatch(
            token_ids=np.zeros(num_tokens, np.int32),
            positions=np.concatenate([np.arange(n) for n in lens]).astype(np.int32),
            slot_mapping=np.full(num_tokens, -1, np.int32),
            block_tables=np.tile(np.arange(n_blocks, dtype=np.int32), (len(lens), 1)),
            context_lens=np.asarray(lens, np.int32),
            query_start_loc=qsl,
            num_decodes=0,
        )
        if self.kv_groups is not None:  # every group reads the same scratch blocks
            n = self.kv_groups.num_groups - 1
            batch.kv_groups = self.kv_groups
            batch.group_tables, batch.group_slots = (
                (batch.block_tables,) * n,
                (batch.slot_mapping,) * n,
            )
        scratch = self.device.zeros(self.cache_shape(n_blocks), self.dtype)
        saved, self.kv_cache = self.kv_cache, scratch
        try:
            self._run_eager(batch)
        finally:
            self.kv_cache = saved
