"""One rank of the NumPy backend: the same forward over this rank's layers (its pipeline stage,
``sharding.Stage``) and, within them, its heads, MLP slice and vocabulary rows (its tensor-
parallel shard, ``sharding.Shard``).

Where the math needs the other ranks of its stage: the embedding and the two row-sharded
products of each layer are all-reduced, the LM head's columns gathered (so every rank of the
last stage ends a step with the whole logits). Between stages: the first embeds, each stage
but the last sends its hidden state and residual to the same tensor-parallel rank of the next,
which receives them instead of embedding; only the last stage has logits.

A grouped model's KV groups: the stage's pool holds its layers' groups (``KVGroups.stage``), and
each step's batch reads them through those (the engine's batch names every layer's).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine.backends.base import greedy_ids
from engine.backends.numpy_backend import F32, NumpyBackend, matmul
from engine.devices.comm import ShmComm
from engine.executor.sharding import Shard, Stage
from model_loader.config import ModelConfig
from model_loader.weights import ModelWeights


class RankNumpyBackend(NumpyBackend):
    """``kv_cache``: (its layers, 2, N, bs, its K/V heads, hd). ``prev``/``next``: the pipe
    ends from the previous stage and to the next one (None at either end of the pipeline)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: ModelWeights,
        engine_config,
        shard: Shard,
        stage: Stage,
        comm: ShmComm,
        prev=None,
        next=None,
        timeout: float = 60.0,
    ):
        local_cfg = shard.config(stage.config(cfg))
        super().__init__(local_cfg, shard.weights(stage.weights(weights), cfg), engine_config)
        self.full_cfg, self.shard, self.stage, self.comm = cfg, shard, stage, comm
        self.prev, self.next, self.timeout = prev, next, timeout

    def use_kv_groups(self, groups) -> None:
        """The engine's KV groups as this stage holds them: its layers' (re-based slots)."""
        super().use_kv_groups(groups.stage(self.stage.layers))

    def forward(self, batch):
        """(B, V) logits on the last stage, None on the others."""
        return self._logits(batch)

    def forward_greedy(self, batch):
        logits = self._logits(batch)
        return None if logits is None else greedy_ids(logits)

    def _logits(self, batch):
        out = self._stage(batch, None if self.stage.first else self._receive())
        if not self.stage.last:
            self.next.send(out)
            return None
        return out

    def hidden_states(self, batch):
        """The pooling runner's (T, D) final-normed rows on the last stage, None on the others
        (each sends its hidden state on, as a forward does)."""
        out = self._stage(batch, None if self.stage.first else self._receive(), pooled=True)
        if not self.stage.last:
            self.next.send(out)
            return None
        return out

    def head_logits(self, h: np.ndarray):
        """A reranker's (R, V) logits on the last stage (its ranks gather them), else None."""
        return super().head_logits(h) if self.stage.last else None

    def forward_stage(self, batch, hidden, what: str):
        """This stage's part of a step (``what``: forward, forward_greedy or hidden_states),
        its input given (the ray executor hands the stages' hidden states on itself): the
        (hidden, residual) for the next stage, or on the last the logits ((B,) argmax ids for
        forward_greedy; the final-normed rows for hidden_states)."""
        if hidden is not None:  # read-only views of Ray's object store: the layers add in place
            hidden = tuple(np.array(a) for a in hidden)
        out = self._stage(batch, hidden, pooled=what == "hidden_states")
        return greedy_ids(out) if what == "forward_greedy" and self.stage.last else out

    def _stage(self, batch, hidden, pooled: bool = False):
        """(T, D) hidden and residual after this stage's layers; on the last the (B, V) logits,
        or with ``pooled`` every row after the final norm (T, D)."""
        if self.kv_groups is not None:  # the engine's groups name every layer: the stage's
            batch = dataclasses.replace(batch, kv_groups=self.kv_groups)
        if self.stage.first:
            x, residual = self._embed(batch.token_ids), None  # (T, D)
        else:
            x, residual = hidden
        x, residual = self._run_layers(x, residual, batch)
        if not self.stage.last:
            return x, residual
        return self._final_rows(x, residual) if pooled else self._head(x, residual, batch)

    def _receive(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.prev.poll(self.timeout):
            raise RuntimeError(
                f"stage {self.stage.index}: the previous stage sent nothing in {self.timeout:g} s"
            )
        return self.prev.recv()

    # ---- the collectives of its stage ----
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
