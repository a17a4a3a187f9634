"""CUDA graphs for the GPU backend's pure-decode steps: one graph per batch size (powers of two up
to ``max_num_seqs``), captured at startup over the inputs' buffers of the largest, replayed for
the next size up with the extra rows padded (they write no KV and read one cached token), the
argmax of each row computed inside the graph. A failed capture logs why and leaves the backend
eager. ``DecodeGraphs`` is a part of ``CupyBackend`` (its device, kernels and ``_step``).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from engine.backends.cupy_step import StepInputs
from engine.backends.forward_batch import ForwardBatch
from engine.utils import MiB, cdiv

log = logging.getLogger("engine.backend")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then every 32 up to ``max_num_seqs`` (always included)."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32) if b < max_num_seqs]
    sizes += list(range(64, max_num_seqs, 32))
    return sizes + [max_num_seqs]


def fill_padding(fields, lo: int, hi: int) -> None:
    """Rows lo..hi-1 of the graph inputs: token 0 at position 0, no KV write (slot -1), one
    context token read from block 0, so a padding row is harmless and its logits ignored
    (in every KV group: the other groups' slots and tables follow the first five fields)."""
    tok, pos, slots, lens, tables, *groups = fields
    tok[lo:hi], pos[lo:hi], slots[lo:hi], lens[lo:hi], tables[lo:hi] = 0, 0, -1, 1, 0
    n = len(groups) // 2
    for group_slots, group_tables in zip(groups[:n], groups[n:], strict=True):
        group_slots[lo:hi], group_tables[lo:hi] = -1, 0


class DecodeGraphs:
    """Decode steps through captured graphs (a CupyBackend's)."""

    def _graph_buffers(self, xp_zeros, Bmax: int, M: int):
        """(token_ids, positions, slots, context_lens, block_tables, then each other KV
        group's slots, then its block tables) views of one flat buffer."""
        n = self._other_groups
        flat = xp_zeros(((4 + n) * Bmax + (1 + n) * Bmax * M,), np.int32)
        f = [flat[i * Bmax : (i + 1) * Bmax] for i in range(4 + n)]
        t = (4 + n) * Bmax
        tables = [
            flat[t + i * Bmax * M : t + (i + 1) * Bmax * M].reshape(Bmax, M) for i in range(1 + n)
        ]
        return flat, (*f[:4], tables[0], *f[4:], *tables[1:])

    @property
    def _other_groups(self) -> int:
        """KV groups after the first (0: one group)."""
        return 0 if self.kv_groups is None else self.kv_groups.num_groups - 1

    def _capture_graphs(self) -> None:
        """Capture the decode graphs; if anything fails, log why and run eager instead."""
        try:
            self._capture_all()
        except Exception as exc:  # any failure: the engine still serves, without graphs
            self.graphs = {}
            self.device.release_graph_pool()
            log.warning(
                "CUDA graphs off, running eager: capturing the decode step failed (%s: %s)",
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )

    def _capture_all(self) -> None:
        sizes = graph_batch_sizes(self.max_graph_batch)
        M = cdiv(self.max_model_len, self.block_size)
        self._staging = [self._graph_buffers(self._pinned_zeros, sizes[-1], M) for _ in "ab"]
        self._stage = 0
        self._host_flat, self._host = self._staging[0]
        self._dev_flat, dev = self._graph_buffers(self.device.zeros, sizes[-1], M)
        self._dev_tokens = dev[0]  # (Bmax,)
        self._graph_ids = self.device.zeros((sizes[-1],), np.int32)  # (Bmax,) greedy ids out
        fill_padding(self._host, 0, sizes[-1])
        self.device.copy_to(self._dev_flat, self._host_flat)
        t0 = time.perf_counter()
        n = self._other_groups
        for G in reversed(sizes):  # largest first: it sizes the shared pool
            tok, pos, slots, lens, tables, *groups = (a[:G] for a in dev)
            inp = StepInputs(tok, pos, slots, lens, tables, None, None)
            inp.group_slots, inp.group_tables = tuple(groups[:n]), tuple(groups[n:])
            inp.kv_groups = self.kv_groups
            self.graphs[G] = self.device.capture(lambda inp=inp, G=G: self._graph_step(inp, G))
        self.device.synchronize()
        log.info(
            "CUDA graphs: %d decode batch sizes (%s) captured in %.2f s, graph pool %.1f MiB",
            len(sizes),
            ", ".join(map(str, sizes)),
            time.perf_counter() - t0,
            self.device.graph_pool_bytes() / MiB,
        )

    def _graph_step(self, inp: StepInputs, G: int):
        """A graph's step: (G, V) logits, and their argmax in ``_graph_ids[:G]``."""
        logits = self._step(inp, G, G, G, self.max_model_len)  # (G, V)
        self.k.sample_greedy(self._graph_ids[:G], logits)
        return logits

    def _pinned_zeros(self, shape, dtype) -> np.ndarray:
        a = self.device.pinned_empty(shape, dtype)
        a[...] = 0
        return a

    def _replay(self, batch: ForwardBatch, take=None):
        """A pure-decode step through the graph of the next batch size up (padded rows) ->
        (B, V) float32 logits on the device (the real rows of the graph's output); the argmax
        of each row is in ``_graph_ids[:B]``. ``take(tokens)``: as in ``_run_eager``."""
        B = batch.num_seqs
        G = min(g for g in self.graphs if g >= B)
        self._stage ^= 1
        self._host_flat, self._host = self._staging[self._stage]
        tok, pos, slots, lens, tables, *groups = self._host
        tok[:B], pos[:B], slots[:B] = batch.token_ids, batch.positions, batch.slot_mapping
        lens[:B] = batch.context_lens
        m = batch.block_tables.shape[1]
        tables[:B, :m], tables[:B, m:] = batch.block_tables, -1
        n = len(groups) // 2
        for i, (s, t) in enumerate(zip(groups[:n], groups[n:], strict=True)):
            s[:B], t[:B, :m], t[:B, m:] = batch.group_slots[i], batch.group_tables[i], -1
        fill_padding(self._host, B, G)
        self.device.copy_to(self._dev_flat, self._host_flat)
        if take is not None:
            take(self._dev_tokens[:B])
        logits = self.graphs[G]()  # (G, V) on the device
        return logits[:B]  # (B, V) a contiguous view; padding rows dropped
