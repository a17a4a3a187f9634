"""The model forward over the paged KV cache, on the host with NumPy.

Weights are re-arranged once for speed: every matrix pre-transposed to (in, out) and contiguous,
Q/K/V fused into one matrix and gate/up into another, so a layer is four matrix products. Everything
that is not a matrix product goes through ``self.ops`` (``fast_ops``; the tests' oracles in
``reference/kernel_ops.py`` has the same functions), so another ops module swaps the math
underneath.
"""

from __future__ import annotations

import logging

import numpy as np

from engine.backends import fast_ops
from engine.backends.base import (
    Backend,
    copy_host_blocks,
    greedy_ids,
    numpy_dtype,
    resolve_kv_dtype,
    retain_freed_memory,
)
from engine.backends.fast_ops import matmul  # noqa: F401  (the tensor-parallel ranks' too)
from engine.backends.forward_batch import ForwardBatch
from engine.backends.moe import experts_forward
from engine.backends.packed_weights import F32, PackedLayer, pack_weights
from engine.backends.quant import HEAD_FORMAT, quantize
from model_loader.config import ModelConfig
from model_loader.quantize_weights import MIXES, quantize_weights
from model_loader.weights import ModelWeights

log = logging.getLogger("engine.backend")


class NumpyBackend(Backend):
    """Paged-attention forward in NumPy. ``kv_cache``: (L, 2, N, bs, Hkv, hd), or a grouped
    model's (G, 2, N, bs, Hkv, hd)."""

    name = "numpy"
    supports_kv_groups = True

    def __init__(self, model_config: ModelConfig, weights: ModelWeights, engine_config, ops=None):
        retain_freed_memory(False)  # until the weights are packed
        self.cfg = model_config
        self.ops = ops if ops is not None else fast_ops
        self.block_size = engine_config.block_size
        self.kv_dtype = resolve_kv_dtype(engine_config.dtype, model_config, on_gpu=False)
        self.np_kv_dtype = numpy_dtype(self.kv_dtype)
        cache = getattr(engine_config, "kv_cache_dtype", "auto")
        self._cache_dtype = self.kv_dtype if cache == "auto" else cache
        asked = getattr(engine_config, "quantization", None)
        if asked in MIXES:  # a k-quant mix: the matrices in GGUF blocks, kept as a file's are
            if self.np_kv_dtype != F32:
                raise ValueError(f"--quantization {asked} runs with --dtype float32 or auto")
            weights = quantize_weights(weights, model_config, asked)
        kind = self._quantization(None if asked in MIXES else asked)
        self.layers, rest = pack_weights(
            weights,
            self.np_kv_dtype,
            model_config.norm_offset,
            self._matrix_store(kind),
            self._matrix_store(kind, head=True),
            model_config.moe,
        )
        self.quantization = asked if asked in MIXES else kind
        # Gemma's sqrt(D), rounded to the weights' dtype as Hugging Face rounds it
        self.embed_scale = float(self.np_kv_dtype.type(model_config.embed_scale))
        self.embed, self.final_norm, self.lm_head = (
            rest["embed"],
            rest["final_norm"],
            rest["lm_head"],
        )
        self._stored()
        retain_freed_memory()
        self.scale = model_config.attn_scale  # q.k's factor
        self.softcap = model_config.attn_softcap  # scores soft-capped at it (0: not)
        self.kv_cache: np.ndarray | None = None  # (L, 2, N, bs, Hkv, hd)
        self.loras: dict = {}  # LoRA slot -> its adapter's LoRAWeights (enable_lora)
        self._lora_kept: dict = {}  # (active slots, layer, matrix) -> their pairs as multiplied
        self._lora_memo = None  # (a batch's lora_slots, [(slot, rows)])
        self.cpu_cache: np.ndarray | None = None  # (L, 2, N_cpu, bs, Hkv, hd)

    # ---- weights in fewer bytes ----
    def _quantization(self, asked: str | None) -> str | None:
        """The matrices' format: --quantization's (None: the weights' dtype)."""
        return asked

    def _matrix_store(self, quantization: str | None, head: bool = False):
        """How a packed matrix is kept (the LM head when ``head``): None (float32 as packed),
        or a function of a (K, N) float32 matrix. A quantization here: quantized and
        dequantized to float32 at once, the plain reference for the cpu backend's products of
        the same weights (whose x is quantized too for the block formats)."""
        if quantization is None:
            return None
        kind = HEAD_FORMAT[quantization] if head else quantization
        return lambda w: quantize(w, kind).dequantize()

    def _matrix_shapes(self) -> list[tuple[int, int]]:
        """The (K, N) of a layer's four matrices and of the LM head, from the config (and of a
        mixture's experts, the shared one's too)."""
        c = self.cfg
        d, f = c.hidden_size, c.intermediate_size
        shapes = [(d, c.q_dim + 2 * c.kv_dim), (c.q_dim, d), (d, 2 * f), (f, d), (d, c.vocab_size)]
        for width in (c.moe.intermediate_size, c.moe.shared_intermediate_size) if c.moe else ():
            shapes += [(d, 2 * width), (width, d)] if width else []
        return shapes

    def _stored(self) -> None:
        """Called once the matrices are packed and stored (the cpu backend logs its choice)."""

    # ---- memory accounting ----
    @property
    def weights_bytes(self) -> int:
        arrays = [self.embed, self.final_norm, self.lm_head]
        arrays += [a for lw in self.layers for a in lw.arrays()]
        return sum(a.nbytes for a in arrays)

    def expert_tokens(self) -> list[list[int]] | None:
        if self.cfg.moe is None:  # (asked after every step: a dense model's answer at once)
            return None
        layers = [(i, lw.experts) for i, lw in enumerate(self.layers) if lw.experts is not None]
        return [[i, *ex.chosen.tolist()] for i, ex in layers] or None

    def profile_peak_bytes(self, num_tokens: int, max_seq_len: int, num_seqs: int) -> int:
        """Activation peak of a forward over ``num_tokens`` tokens in ``num_seqs`` sequences, the
        longest ``max_seq_len`` tokens (an analytic count; tests check it against tracemalloc)."""
        c = self.cfg
        t, s = num_tokens, min(max_seq_len, num_tokens)
        qkv = c.q_dim + 2 * c.kv_dim
        ffn = c.intermediate_size
        if c.moe is not None:  # each token's k pairs: gathered rows, gate|up, act, down
            ffn = max(ffn, c.moe.top_k * (c.moe.intermediate_size + c.hidden_size))
            ffn = max(ffn, c.moe.shared_intermediate_size + c.hidden_size)  # Qwen2-MoE's
        per_token = 3 * c.hidden_size + 2 * qkv + 2 * c.q_dim + 4 * ffn
        seq_kv = 4 * s * c.kv_dim  # one sequence's gathered K and V (+ transposed copies)
        rows = min(s, fast_ops.QUERY_CHUNK)
        scores = 3 * c.num_attention_heads * rows * s  # scores, mask, probs
        logits = 2 * min(num_seqs, t) * c.vocab_size
        return 4 * (t * per_token + seq_kv + scores + logits)

    # ---- cache ----
    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        dtype = numpy_dtype(self.cache_dtype)
        self.kv_cache = np.zeros(self.cache_shape(num_blocks), dtype)
        self.cpu_cache = np.zeros(self.cache_shape(num_cpu_blocks), dtype)

    def swap_out(self, pairs) -> None:
        copy_host_blocks(self.cpu_cache, self.kv_cache, pairs)

    def swap_in(self, pairs) -> None:
        copy_host_blocks(self.kv_cache, self.cpu_cache, pairs)

    def copy_blocks(self, pairs) -> None:
        if pairs:
            self.ops.copy_blocks(self.kv_cache, self.kv_cache, pairs)

    # ---- forward ----
    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """One step over the flattened batch -> (B, V) float32 logits, one row per sequence."""
        return self._logits(batch)

    def forward_greedy(self, batch: ForwardBatch) -> np.ndarray:
        """One step -> (B,) int32 argmax of each row's logits (the first maximum), as the
        ``sample_greedy`` kernel: NaN never wins, a row with nothing above -inf gives -1."""
        return greedy_ids(self._logits(batch))

    def _logits(self, batch: ForwardBatch) -> np.ndarray:
        # the layers over the flat batch -> (B, V) float32
        x, residual = self._run_layers(self._embed(batch.token_ids), None, batch)  # (T, D) x 2
        return self._head(x, residual, batch)

    def _run_layers(self, x: np.ndarray, residual: np.ndarray | None, batch: ForwardBatch):
        # (T, D) hidden states and residual (None before the first layer) through every layer
        ops, c = self.ops, self.cfg
        for layer, lw in enumerate(self.layers):
            if residual is None:
                residual, h = x, ops.rms_norm(x, lw.attn_norm, c.rms_norm_eps)  # (T, D)
            else:
                h, residual = ops.fused_add_rms_norm(x, residual, lw.attn_norm, c.rms_norm_eps)
            x = self._post_norm(self._attention(h, lw, layer, batch), lw.post_attn_norm)
            h, residual = ops.fused_add_rms_norm(x, residual, lw.mlp_norm, c.rms_norm_eps)
            x = self._post_norm(self._mlp(h, lw, layer, batch), lw.post_mlp_norm)  # (T, D)
        return x, residual

    def _mlp(self, h: np.ndarray, lw: PackedLayer, layer: int, batch: ForwardBatch):
        # h (T, D) normed -> (T, D): the gated MLP, or a layer of experts
        if lw.experts is not None:
            return self._reduce(experts_forward(h, lw.experts, self.ops, self.cfg.hidden_act))
        gate_up = self._mm(h, lw, layer, "w_gate_up", batch)  # (T, 2F)
        act = self.ops.act_and_mul(gate_up, self.cfg.hidden_act)  # (T, F)
        return self._reduce(self._mm(act, lw, layer, "w_down", batch))  # (T, D)

    def _post_norm(self, x: np.ndarray, weight: np.ndarray | None) -> np.ndarray:
        """(T, D) a branch's output, RMS-normalised where the model has sandwich norms."""
        return x if weight is None else self.ops.rms_norm(x, weight, self.cfg.rms_norm_eps)

    def _final_softcap(self, logits: np.ndarray) -> np.ndarray:
        """(R, V) logits soft-capped where the model says so (Gemma 2): tanh(x / cap) * cap."""
        cap = self.cfg.final_softcap
        if cap:
            logits = np.tanh(logits / F32.type(cap)) * F32.type(cap)
        return logits

    def hidden_states(self, batch: ForwardBatch) -> np.ndarray:
        """One step -> (T, D) float32: every row's last hidden state after the final norm
        (transformers' ``last_hidden_state``), for the pooling runner."""
        x, residual = self._run_layers(self._embed(batch.token_ids), None, batch)  # (T, D) x 2
        return self._final_rows(x, residual)

    def _final_rows(self, x: np.ndarray, residual: np.ndarray) -> np.ndarray:
        """(T, D) float32: every row after the last residual add and the final norm."""
        h, _ = self.ops.fused_add_rms_norm(x, residual, self.final_norm, self.cfg.rms_norm_eps)
        return np.asarray(h, dtype=F32)

    def head_logits(self, h: np.ndarray) -> np.ndarray:
        """(R, D) final-normed hidden states -> (R, V) float32 logits (a reranker's rows)."""
        logits = self._lm_head(np.ascontiguousarray(h, dtype=F32))  # (R, V)
        return self._final_softcap(np.asarray(logits, dtype=F32))

    def _head(self, x: np.ndarray, residual: np.ndarray, batch: ForwardBatch) -> np.ndarray:
        rows = batch.output_rows  # (R,): each sequence's last token (all of a speculated run)
        c = self.cfg
        h, _ = self.ops.fused_add_rms_norm(
            x[rows], residual[rows], self.final_norm, c.rms_norm_eps
        )  # (R, D)
        return self._final_softcap(self._lm_head(h))  # (R, V)

    # the three places a tensor-parallel rank differs (engine/executor/rank_numpy.py)
    def _embed(self, token_ids: np.ndarray) -> np.ndarray:
        return self.ops.embedding(token_ids, self.embed, self.embed_scale)  # (T, D)

    def _reduce(self, x: np.ndarray) -> np.ndarray:
        """A row-sharded product's partial sums -> the whole (here: already whole)."""
        return x

    def _lm_head(self, h: np.ndarray) -> np.ndarray:
        return self.ops.matmul(h, self.lm_head)  # (R, D) -> (R, V)

    def _attention(self, h: np.ndarray, lw: PackedLayer, layer: int, b: ForwardBatch):
        # h: (T, D) normalized -> (T, D)
        c, n = self.cfg, h.shape[0]
        slot, b = b.for_layer(layer)  # KV groups: its slot, its group's tables
        k_cache, v_cache = self.kv_cache[slot, 0], self.kv_cache[slot, 1]  # (N, bs, Hkv, hd)
        qkv = self._mm(h, lw, layer, "w_qkv", b)  # (T, H*hd + 2*Hkv*hd)
        q = self._rotary_cache(qkv, lw, k_cache, v_cache, b, c.layer_rope(layer))  # (T, H, hd)
        out = self._attend(q, k_cache, v_cache, b, c.window(layer), lw.sinks)  # (T, H, hd)
        y = self._reduce(self._mm(out.reshape(n, c.q_dim), lw, layer, "w_o", b))  # (T, D)
        return y if lw.b_o is None else y + lw.b_o

    def _mm(self, x: np.ndarray, lw: PackedLayer, layer: int, name: str, b: ForwardBatch):
        """x (T, K) @ the layer's matrix ``name`` (K, N) -> (T, N), plus each LoRA row's update."""
        y = self.ops.matmul(x, getattr(lw, name))
        if b.lora_slots is not None:
            self._add_lora(y, x, layer, name, b.lora_slots)
        return y

    def _add_lora(self, y: np.ndarray, x: np.ndarray, layer: int, name: str, slots: np.ndarray):
        """y[rows] += each adapter's update of its rows (the base model's rows, slot -1, take
        nothing): the segmented low-rank products of Punica and S-LoRA. The step's adapters'
        A side by side make one product for the whole batch (x @ [A_1 .. A_n], small: the
        ranks are); each adapter's rows then take each module's columns of it through the
        module's B into the module's output columns. Through the backend's own product (the
        cpu backend's packed layouts); a step whose rows all run one adapter gathers nothing."""
        plan = self._lora_rows(slots)
        stack = self._lora_stack(tuple(s for s, _ in plan), layer, name)
        if stack is None:  # none of the step's adapters changes this matrix
            return
        mm = self.ops.matmul
        a, parts = stack  # (K, sum R); [(slot, [(first column of t, last, output column, B)])]
        t = mm(x, a)  # (T, sum R)
        rows_of = dict(plan)
        for slot, bs in parts:
            rows = rows_of[slot]
            ts = t if rows is None else t[rows]  # (S, sum R): its rows
            for r0, r1, c0, b in bs:
                upd = mm(np.ascontiguousarray(ts[:, r0:r1]), b)  # (S, r) -> (S, n)
                if rows is None:  # every row
                    y[:, c0 : c0 + upd.shape[1]] += upd
                else:
                    y[rows, c0 : c0 + upd.shape[1]] += upd

    def _lora_stack(self, active: tuple[int, ...], layer: int, name: str):
        """For the step's adapters and one matrix: (their A side by side, kept as this backend
        multiplies it; [(slot, [(first column, last, output column, B) of each module])]);
        None when none of them changes it."""
        key = (active, layer, name)
        if key not in self._lora_kept:
            pairs = [(s, self.loras[s].layers[layer].get(name)) for s in active]
            pairs = [(s, p) for s, p in pairs if p is not None]
            stack = None
            if pairs:
                a = np.concatenate([p[0] for _, p in pairs], axis=1)  # (K, sum R)
                starts = np.cumsum([0] + [p[0].shape[1] for _, p in pairs])[:-1].tolist()
                parts = [
                    (s, [(c + r0, c + r1, c0, self._lora_store(b)) for r0, r1, c0, b in p[1]])
                    for (s, p), c in zip(pairs, starts, strict=True)
                ]
                stack = (self._lora_store(a), parts)
            self._lora_kept[key] = stack
        return self._lora_kept[key]

    def _lora_rows(self, slots: np.ndarray) -> list:
        """[(slot, its rows, or None for every row)] of a batch, worked out once per batch."""
        memo = self._lora_memo
        if memo is None or memo[0] is not slots:
            active = np.unique(slots[slots >= 0]).tolist()
            if len(active) == 1 and bool((slots == active[0]).all()):
                plan = [(active[0], None)]
            else:
                plan = [(s, np.flatnonzero(slots == s)) for s in active]
            self._lora_memo = memo = (slots, plan)
        return memo[1]

    def _lora_store(self, m: np.ndarray):
        """An adapter's matrix as this backend keeps it (float32; the cpu backend packs it)."""
        return np.ascontiguousarray(m, dtype=F32)

    @property
    def lora_bytes(self) -> int:
        """The adapters' matrices as kept for the step's products (each array once)."""
        kept = {id(a): a for v in self._lora_kept.values() if v for a in _arrays(v)}
        return sum(int(a.nbytes) for a in kept.values())

    def set_lora(self, slot: int, weights) -> None:
        """Slot ``slot`` holds this adapter's pairs (engine/lora/adapter.py) from now on."""
        self.loras[slot] = weights
        self._lora_kept = {k: v for k, v in self._lora_kept.items() if slot not in k[0]}

    def _attend(self, q: np.ndarray, k_cache, v_cache, b: ForwardBatch, window: int, sinks=None):
        """q (T, H, hd) rotated, this step's K and V already in the cache -> (T, H, hd): the
        decodes' rows through decode attention, the prefills' through prefill attention
        (``sinks`` (H,): gpt-oss's sink logits, passed to the ops only where a model has them)."""
        ops, extra = self.ops, {} if sinks is None else {"sinks": sinks}
        out = np.empty(q.shape, F32)  # (T, H, hd)
        nd = b.num_decodes
        if nd:  # decodes: rows 0..nd-1, one per sequence
            out[:nd] = ops.paged_attention_decode(
                q[:nd],
                k_cache,
                v_cache,
                b.block_tables[:nd],
                b.context_lens[:nd],
                self.scale,
                window,
                self.softcap,
                **extra,
            )
        if nd < b.num_seqs:  # prefills: the remaining rows
            qsl = b.query_start_loc[nd:] - b.query_start_loc[nd]
            out[b.query_start_loc[nd] :] = ops.paged_attention_prefill(
                q[b.query_start_loc[nd] :],
                k_cache,
                v_cache,
                b.block_tables[nd:],
                qsl,
                b.context_lens[nd:],
                self.scale,
                window,
                self.softcap,
                **extra,
            )
        return out

    def _rotary_cache(self, qkv, lw: PackedLayer, k_cache, v_cache, b: ForwardBatch, rope):
        """qkv (T, H*hd + 2*Hkv*hd) -> rotated q (T, H, hd); k and v rotated (``rope``: the
        layer's RopeParams) and written into their cache slots (the native CPU backend does
        all of it in one kernel)."""
        c, ops, n = self.cfg, self.ops, qkv.shape[0]
        if lw.b_qkv is not None:
            qkv += lw.b_qkv
        qkv = self._olmoe_qkv(qkv, lw)
        q = qkv[:, : c.q_dim].reshape(n, c.num_attention_heads, c.head_dim)  # (T, H, hd)
        k = qkv[:, c.q_dim : c.q_dim + c.kv_dim].reshape(n, c.num_key_value_heads, c.head_dim)
        v = qkv[:, c.q_dim + c.kv_dim :].reshape(n, c.num_key_value_heads, c.head_dim)
        if lw.q_norm is not None and not c.qk_norm_whole:  # each head normalised before RoPE
            q = ops.rms_norm(q.reshape(-1, c.head_dim), lw.q_norm, c.rms_norm_eps).reshape(q.shape)
            k = ops.rms_norm(k.reshape(-1, c.head_dim), lw.k_norm, c.rms_norm_eps).reshape(k.shape)
        q, k = ops.rotary(q, k, b.positions, rope)
        ops.reshape_and_cache(k, v, k_cache, v_cache, b.slot_mapping)
        return q

    def _olmoe_qkv(self, qkv: np.ndarray, lw: PackedLayer) -> np.ndarray:
        """qkv (T, H*hd + 2*Hkv*hd) biased -> the same, OLMoE's way where the config says so:
        each row's q and k columns RMS-normalised as a whole, then every value clamped to
        +-clip_qkv."""
        c, q, kv = self.cfg, self.cfg.q_dim, self.cfg.kv_dim
        if c.qk_norm_whole:
            qkv[:, :q] = self.ops.rms_norm(
                np.ascontiguousarray(qkv[:, :q]), lw.q_norm, c.rms_norm_eps
            )
            k = np.ascontiguousarray(qkv[:, q : q + kv])  # (T, Hkv*hd)
            qkv[:, q : q + kv] = self.ops.rms_norm(k, lw.k_norm, c.rms_norm_eps)
        if c.clip_qkv is not None:
            np.clip(qkv, -c.clip_qkv, c.clip_qkv, out=qkv)
        return qkv


def _arrays(value):
    """Every array (or packed matrix) inside nested tuples and lists."""
    if isinstance(value, tuple | list):
        for v in value:
            yield from _arrays(v)
    elif hasattr(value, "nbytes"):
        yield value
