"""One tensor-parallel rank of the GPU backend: ``CupyBackend`` over this rank's cut
(``sharding.Shard``), its collectives over NCCL (``nccl.py``), on a GPU or emulated.

Where the math needs the other ranks, the backend's hooks do it, on the device's stream, so a
decode step's graph captures the collectives with the kernels:

    _embed      the ``embedding`` kernel over this rank's vocabulary rows (other ids give zeros),
                then an all-reduce of the (T, D) rows
    _reduce     after the attention's output product and the MLP's down product (row-sharded,
                each rank's a partial sum): an all-reduce, in place
    _lm_head    this rank's logits (B, widest) from its rows of the LM head (zero rows pad the
                shorter slices to ``widest``, as NCCL gathers equal counts), an all-gather to
                (world, B, widest), then each rank's columns put side by side: (B, V) on every
                rank, the same bits, so every rank samples the same tokens

The communicator is joined after the weights are on the device (``join``), with the unique id
that the executor brought from the first rank.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine.backends.cupy_backend import CupyBackend, Workspace
from engine.devices.nccl import NcclComm, nccl_version
from engine.executor.sharding import Shard
from engine.utils import cdiv


class RankCupyBackend(CupyBackend):
    """``kv_cache``: (L, 2, N, bs, its K/V heads, hd) on its device."""

    def __init__(self, cfg, weights, engine_config, shard: Shard, device):
        self.full_cfg, self.shard = cfg, shard
        self.world, V = shard.world, cfg.vocab_size
        self.widest = cdiv(V, self.world)
        self.vocab_parts = [Shard.of(cfg, r, self.world).vocab for r in range(self.world)]
        local = shard.weights(weights, cfg)
        pad = self.widest - len(shard.vocab)
        local = dataclasses.replace(local, lm_head=np.pad(local.lm_head, ((0, pad), (0, 0))))
        super().__init__(shard.config(cfg), local, engine_config, device)
        self.logits_cols = self.widest
        self.comm: NcclComm | None = None

    def unique_id(self):
        """A new communicator's id (asked of the first rank)."""
        return self.device.nccl.get_unique_id()

    def join(self, uid) -> str:
        """Join the ranks' communicator; NCCL's version."""
        lib = self.device.nccl
        with self.device.active():
            self.comm = NcclComm(lib, self.world, uid, self.shard.rank, self.device)
        return nccl_version(lib)

    def step_bytes(
        self, T: int, B: int, partitions: int, layers_with_partials: int = 1, lora: bool = True
    ) -> int:
        """The one rank's step, and the gathered logits: (world, B, widest) and (B, V)."""
        gathered = B * 4 * (self.world * self.widest + self.full_cfg.vocab_size)
        return super().step_bytes(T, B, partitions, layers_with_partials, lora) + gathered

    # ---- the hooks of CupyBackend._step ----
    def _embed(self, out, token_ids) -> None:
        start = self.shard.vocab.start
        self.k.embedding(out, token_ids, self.embed, self.embed_scale, vocab_start=start)
        self.comm.all_reduce(out)  # (T, D)

    def _reduce(self, x) -> None:
        self.comm.all_reduce(x)

    def _lm_head(self, ws: Workspace):
        B = ws.last_h.shape[0]
        self.gemm(ws.last_h, self.lm_head, ws.logits)  # (B, widest) this rank's columns
        gathered = self.device.empty((self.world, B, self.widest), np.float32)
        self.comm.all_gather(ws.logits, gathered)  # (world, B, widest)
        logits = self.device.empty((B, self.full_cfg.vocab_size), np.float32)  # (B, V)
        for r, part in enumerate(self.vocab_parts):
            logits[:, part.start : part.stop] = gathered[r, :, : len(part)]
        return logits
