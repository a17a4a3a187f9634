"""Which part of the model each rank holds, and its weights cut to that part.

Pipeline parallel: stage s of P holds a near-equal range of the layers (``Stage``), the first
stage the embedding as well, the last the final norm and the LM head; the hidden state and the
residual go from each stage to the next.

Tensor parallel, within a stage: Megatron's split, as vLLM does it. Rank r of N holds:

- attention: query heads ``H/N`` (``q_heads``), the K/V heads they read (``kv_heads``): ``Hkv/N``
  of them when N divides Hkv, else the one K/V head its query heads share (replicated on N/Hkv
  ranks); Wq, Wk, Wv cut by rows (the heads' columns of the fused QKV product), Wo by columns, so
  each rank's attention output is a partial sum, all-reduced;
- MLP: a slice of the intermediate dimension (``ffn``, near-equal slices, any N): gate and up
  by rows, down by columns, a partial sum, all-reduced;
- vocabulary: a slice of the rows of the embedding (a token outside it embeds as zeros, so the
  all-reduce of the ranks' embeddings is exact) and of the LM head (the ranks' logits gathered);
- norms: whole, on every rank.

Each rank's KV cache holds its K/V heads only; the block manager is unchanged: block b names
the same tokens on every rank. A grouped model's KV groups (engine/backends/kv_groups.py): every
rank keeps the engine's groups, a pipeline stage those of its layers (``KVGroups.stage``: the
same group ids, its slots re-based), and whole blocks for the KV tiers are gathered from the
stages' slots and cut back into them (``gather_slots``, ``cut_slots``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from model_loader.config import ModelConfig
from model_loader.weights import ModelWeights


def check_tensor_parallel(cfg: ModelConfig, n: int) -> None:
    """ValueError, one line, for a world size the heads cannot be split into."""
    h, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if h % n:
        raise ValueError(
            f"tensor_parallel_size {n} does not divide the model's {h} attention heads"
        )
    if hkv % n and n % hkv:
        raise ValueError(
            f"tensor_parallel_size {n} neither divides the model's {hkv} KV heads nor is a "
            "multiple of them"
        )
    if n > 1 and cfg.qk_norm_whole:
        raise ValueError(
            f"tensor_parallel_size {n}: {cfg.family}'s q and k norms span every head at once "
            "(a rank holds only its heads); it runs on one rank, or split by pipeline stages"
        )


def check_pipeline_parallel(cfg: ModelConfig, n: int) -> None:
    if n > cfg.num_hidden_layers:
        raise ValueError(
            f"pipeline_parallel_size {n} is more than the model's {cfg.num_hidden_layers} layers"
        )


def _part(size: int, rank: int, n: int) -> range:
    """Rank's near-equal slice of range(size) (the first ``size % n`` slices one longer)."""
    return range(size * rank // n, size * (rank + 1) // n)


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world``: the heads, intermediate units and vocabulary rows it holds."""

    rank: int
    world: int
    q_heads: range
    kv_heads: range
    ffn: range
    vocab: range
    expert_ffn: range = range(0)  # a mixture's: each expert's units, the shared expert's
    shared_ffn: range = range(0)

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, world: int) -> Shard:
        check_tensor_parallel(cfg, world)
        h, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        q = _part(h, rank, world)
        if hkv % world == 0:
            kv = _part(hkv, rank, world)
        else:  # fewer K/V heads than ranks: the one this rank's query heads read
            first = q.start // cfg.gqa_group
            kv = range(first, first + 1)
        ffn = _part(cfg.intermediate_size, rank, world)
        experts = shared = range(0)
        if cfg.moe is not None:  # each expert split as a dense MLP is
            experts = _part(cfg.moe.intermediate_size, rank, world)
            shared = _part(cfg.moe.shared_intermediate_size, rank, world)
        vocab = _part(cfg.vocab_size, rank, world)
        return cls(rank, world, q, kv, ffn, vocab, experts, shared)

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The model as this rank sees it: its heads, its MLP slice, its vocabulary rows."""
        moe = cfg.moe and dataclasses.replace(
            cfg.moe,
            intermediate_size=len(self.expert_ffn),
            shared_intermediate_size=len(self.shared_ffn),
        )
        return dataclasses.replace(
            cfg,
            num_attention_heads=len(self.q_heads),
            num_key_value_heads=len(self.kv_heads),
            intermediate_size=len(self.ffn),
            vocab_size=len(self.vocab),
            moe=moe,
        )

    def weights(self, w: ModelWeights, cfg: ModelConfig) -> ModelWeights:
        """This rank's cut of the whole model's weights (copies; the whole can be dropped)."""
        hd = cfg.head_dim
        q = slice(self.q_heads.start * hd, self.q_heads.stop * hd)
        kv = slice(self.kv_heads.start * hd, self.kv_heads.stop * hd)
        f = slice(self.ffn.start, self.ffn.stop)
        v = slice(self.vocab.start, self.vocab.stop)

        def rows(a, s):
            return None if a is None else a[s].copy()

        layers = [
            dataclasses.replace(
                lw,
                wq=rows(lw.wq, q),
                wk=rows(lw.wk, kv),
                wv=rows(lw.wv, kv),
                wo=lw.wo[:, q].copy(),
                w_gate=rows(lw.w_gate, f),
                w_up=rows(lw.w_up, f),
                w_down=None if lw.w_down is None else lw.w_down[:, f].copy(),
                bq=rows(lw.bq, q),
                bk=rows(lw.bk, kv),
                bv=rows(lw.bv, kv),
                sinks=rows(lw.sinks, slice(self.q_heads.start, self.q_heads.stop)),
                **self._experts(lw),
            )
            for lw in w.layers
        ]
        return dataclasses.replace(
            w, embed=w.embed[v].copy(), layers=layers, lm_head=w.lm_head[v].copy()
        )

    def _experts(self, lw) -> dict:
        """A sparse layer's cut: each expert's gate and up rows and down columns of this
        rank's units (a GGUF's kept blocks widened as they are cut), the shared expert's
        likewise; the router (its bias too) and the shared expert's gate whole (every rank
        routes every token)."""
        if lw.router is None:
            return {}
        e = slice(self.expert_ffn.start, self.expert_ffn.stop)
        s = slice(self.shared_ffn.start, self.shared_ffn.stop)
        out = {
            "e_gate": lw.e_gate[:, e].copy(),  # (E, F/n, D)
            "e_up": lw.e_up[:, e].copy(),
            "e_down": lw.e_down[:, :, e].copy(),  # (E, D, F/n)
        }
        if lw.s_gate is not None:
            out |= {"s_gate": lw.s_gate[s].copy(), "s_up": lw.s_up[s].copy()}
            out["s_down"] = lw.s_down[:, s].copy()
        if lw.e_gate_bias is not None:  # gpt-oss: its units' gate and up biases; the down
            # bias on rank 0 only (every rank's partial sum is added up: once in all)
            out |= {
                "e_gate_bias": lw.e_gate_bias[:, e].copy(),
                "e_up_bias": lw.e_up_bias[:, e].copy(),
            }
            out["e_down_bias"] = lw.e_down_bias * (self.rank == 0)
        return out


@dataclass(frozen=True)
class Stage:
    """Stage ``index`` of ``count``: the layers it runs."""

    index: int
    count: int
    layers: range

    @classmethod
    def of(cls, cfg: ModelConfig, index: int, count: int) -> Stage:
        check_pipeline_parallel(cfg, count)
        return cls(index, count, _part(cfg.num_hidden_layers, index, count))

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The model as this stage sees it: its layers (and their sliding windows)."""
        a, b = self.layers.start, self.layers.stop
        windows = cfg.layer_windows[a:b] if cfg.layer_windows else ()
        moe = cfg.moe and dataclasses.replace(cfg.moe, sparse=cfg.moe.sparse[a:b])
        return dataclasses.replace(cfg, num_hidden_layers=b - a, layer_windows=windows, moe=moe)

    def weights(self, w: ModelWeights) -> ModelWeights:
        """Its layers; the embedding only on the first stage, the LM head only on the last
        (elsewhere empty: zero rows)."""
        return dataclasses.replace(
            w,
            layers=w.layers[self.layers.start : self.layers.stop],
            embed=w.embed if self.first else w.embed[:0],
            lm_head=w.lm_head if self.last else w.lm_head[:0],
        )


def shard_lora(weights, shard: Shard, stage: Stage, cfg: ModelConfig):
    """This rank's cut of a LoRA adapter (engine/lora/adapter.py ``LoRAWeights``): its stage's
    layers; for the column-split matrices (q|k|v, gate|up) the whole A and each module's B
    columns that land in this rank's output columns; for the row-split ones (o, down) A's rows
    of this rank's inputs and the whole B, whose partial products the all-reduce after them
    sums as it sums the base matrix's (the update is linear in the input rows)."""
    from engine.lora.adapter import LoRAWeights

    hd, f = cfg.head_dim, cfg.intermediate_size
    heads = lambda r, base: np.arange(base + r.start * hd, base + r.stop * hd)  # noqa: E731
    q_cols = heads(shard.q_heads, 0)
    kv = [heads(shard.kv_heads, cfg.q_dim), heads(shard.kv_heads, cfg.q_dim + cfg.kv_dim)]
    ffn = np.arange(shard.ffn.start, shard.ffn.stop)
    cols = {  # full output column -> this rank's, for the column-split matrices
        "w_qkv": np.concatenate([q_cols, *kv]),
        "w_gate_up": np.concatenate([ffn, f + ffn]),
    }
    rows = {"w_o": heads(shard.q_heads, 0), "w_down": ffn}  # this rank's input rows
    layers = []
    for i in stage.layers:
        layer = {}
        for name, (a, bs) in weights.layers[i].items():
            if name in rows:
                layer[name] = (np.ascontiguousarray(a[rows[name]]), bs)
                continue
            where = {c: j for j, c in enumerate(cols[name].tolist())}  # full -> rank column
            parts = []
            for r0, r1, c0, b in bs:
                keep = [j for j in range(b.shape[1]) if c0 + j in where]
                if keep:
                    sub = np.ascontiguousarray(b[:, keep])
                    parts.append((r0, r1, where[c0 + keep[0]], sub))
            layer[name] = (a, parts)
        layers.append(layer)
    return LoRAWeights(weights.name, weights.rank, layers)


def gather_slots(groups, stages: list[tuple[range, np.ndarray]], block_groups) -> np.ndarray:
    """Whole blocks of a grouped pool (G, 2, n, bs, Hkv, hd) from each pipeline stage's (its
    layers, its blocks (G_stage, 2, n, bs, Hkv, hd) in ``KVGroups.stage``'s slots): slot s of a
    block of group g comes from the stage that holds that group's s-th layer (a padded slot,
    which no layer reads, stays zero). ``block_groups``: each block's group (None: group 0)."""
    block_groups = np.zeros(stages[0][1].shape[2], int) if block_groups is None else block_groups
    block_groups = np.asarray(block_groups)  # (n,)
    part = stages[0][1]
    whole = np.zeros((groups.num_slots, *part.shape[1:]), part.dtype)  # (G, 2, n, bs, Hkv, hd)
    for g in np.unique(block_groups).tolist():
        idx = np.flatnonzero(block_groups == g)
        for layers, blocks in stages:
            for mine, slot in groups.stage_slots(layers, g):
                whole[slot][:, idx] = blocks[mine][:, idx]
    return whole


def cut_slots(groups, layers: range, data: np.ndarray, block_groups) -> np.ndarray:
    """The stage running ``layers``: its (G_stage, 2, n, bs, Hkv, hd) cut of whole grouped blocks
    ``data`` (G, 2, n, ...), ``gather_slots``' inverse (its slots no layer of a block's group
    uses there are zero)."""
    block_groups = np.zeros(data.shape[2], int) if block_groups is None else block_groups
    block_groups = np.asarray(block_groups)  # (n,)
    cut = np.zeros((groups.stage(layers).num_slots, *data.shape[1:]), data.dtype)
    for g in np.unique(block_groups).tolist():
        idx = np.flatnonzero(block_groups == g)
        for mine, slot in groups.stage_slots(layers, g):
            cut[mine][:, idx] = data[slot][:, idx]
    return cut
