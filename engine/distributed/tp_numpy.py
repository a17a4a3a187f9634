"""One tensor-parallel rank of the NumPy backend: the same forward over this rank's heads, MLP
slice and vocabulary rows (``sharding.Shard``), with the three collectives where the math needs
the other ranks: the embedding and the two row-sharded products all-reduced, the LM head's
columns gathered (so every rank, rank 0 included, ends a step with the whole logits)."""

from __future__ import annotations

import numpy as np

from reference.config import ModelConfig
from reference.weights import ModelWeights

from ..backends.numpy_backend import F32, NumpyBackend, matmul
from .comm import ShmComm
from .sharding import Shard


class TensorParallelNumpyBackend(NumpyBackend):
    """``kv_cache``: (L, 2, N, bs, Hkv/world or 1, hd), this rank's K/V heads."""

    def __init__(
        self, cfg: ModelConfig, weights: ModelWeights, engine_config, shard: Shard, comm: ShmComm
    ):
        super().__init__(shard.config(cfg), shard.weights(weights, cfg), engine_config)
        self.full_cfg, self.shard, self.comm = cfg, shard, comm

    def _embed(self, token_ids: np.ndarray) -> np.ndarray:
        local = token_ids - self.shard.vocab.start  # (T,)
        mine = (local >= 0) & (local < len(self.shard.vocab))
        x = np.zeros((len(token_ids), self.cfg.hidden_size), F32)  # (T, D)
        x[mine] = self.ops.embedding(local[mine], self.embed, self.embed_scale)
        return self.comm.all_reduce(x)

    def _reduce(self, x: np.ndarray) -> np.ndarray:
        return self.comm.all_reduce(np.ascontiguousarray(x, F32))

    def _lm_head(self, h: np.ndarray) -> np.ndarray:
        widest = -(-self.full_cfg.vocab_size // self.shard.world)
        return self.comm.all_gather(matmul(h, self.lm_head), widest)  # (R, V/world) -> (R, V)
