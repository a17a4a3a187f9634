"""The native CPU backend: the NumPy backend's forward with its matrix products and everything
between them run by the C++ kernels of ``cpu_src/`` (``cpu_ops``): products over weights packed
at load, paged decode and prefill attention, rotary fused with the cache write, the residual add
fused with RMSNorm, SiLU-and-mul, multi-threaded over columns or (sequence, KV head).
The same KV layout and interface; ``auto`` picks it where there is no GPU and g++ is there.

Its matrices (every layer's four and the LM head) are packed once: float32 in panels of 16
columns (the order the products read them in), or plain for OpenBLAS where that measured faster
for the shape on this CPU (``cpu_tuning``, which also times every other format against NumPy);
with ``--dtype bfloat16`` as bf16 panels with
rows in pairs (half the bytes; x rounded to bf16 in each product, AVX512-BF16's dot products
where the CPU has them); with ``--quantization int8`` as int8 and a scale per column (a
quarter), with ``--quantization q8_0|q4_0|q4_1`` in llama.cpp's block formats (float16 scales
per 32 inputs; the LM head Q8_0 under the 4-bit ones); a GGUF's k-quant, 5-bit and MXFP4
matrices (Q2_K to Q6_K, Q5_0, Q5_1, MXFP4, and beside them its Q8_0/Q4_0/Q4_1 ones) as the
file's blocks, a fused one of mixed types in parts (``quant.keep_stored``); ``cpu_ops.matmul``
multiplies them by x, accumulating in float32 (the block formats: x quantized to 8 bits per 32,
or per 256 for the k-quants, integer dot products). The startup log states the bytes held by format.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np

from engine.backends import cpu_ops, cpu_tuning, fast_ops
from engine.backends.cpu_experts import native_experts
from engine.backends.cpu_native import NativeBuildError, library, threads
from engine.backends.forward_batch import ForwardBatch
from engine.backends.numpy_backend import NumpyBackend, _arrays
from engine.backends.packed_weights import PackedLayer
from engine.backends.quant import (
    HEAD_FORMAT,
    PANEL,
    bytes_by_kind,
    keep_stored,
    quantize,
    to_bf16,
    to_bf16_panels,
    to_int8_panels,
    to_panels,
)
from model_loader.config import ModelConfig
from model_loader.weights import ModelWeights

F32 = np.dtype(np.float32)
# tokens a sequence may bring to a step that runs as decodes, one a token (a speculative
# verify's k + 1; longer runs go to the prefill attention, which shares each key among queries)
SHORT_RUN = 16
log = logging.getLogger("engine.backend")
_ptr, _i32c = ctypes.c_void_p, ctypes.c_int32


def _short_runs(b: ForwardBatch) -> bool:
    """Whether every sequence brings at most SHORT_RUN tokens to the step."""
    return int(np.diff(b.query_start_loc).max(initial=0)) <= SHORT_RUN


class _Layer(ctypes.Structure):  # cpu_src/decode_layers.cpp: Layer
    _fields_ = [
        *((name, _ptr) for name in ("attn_norm", "mlp_norm", "b_qkv", "q_norm", "k_norm")),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("window", ctypes.c_int64),
        ("group", ctypes.c_int64),
        *((name, cpu_ops.Matrix) for name in ("qkv", "o", "gate_up", "down")),
        ("experts", _ptr),  # a layer of experts' Experts (engine/backends/cpu_experts.py)
        ("post_attn_norm", _ptr),  # Gemma 2 and 3's sandwich norms
        ("post_mlp_norm", _ptr),
        ("local_rope", ctypes.c_int64),  # Gemma 3's sliding layers: the step's local cos/sin
    ]


_SIZES = ("T", "D", "H", "hkv", "hd", "F", "bs", "max_blocks", "cache_dtype", "threads")
_ARRAYS = ("x", "residual", "h", "qkv", "q", "attn", "gate_up", "act_out", "cos", "sin", "slots")
_LORA = ("lora", "lora_slots", "lora_x", "lora_t", "lora_rows")
_MATRICES = ("w_qkv", "w_o", "w_gate_up", "w_down")  # PackedLayer's, in LoraLayer's order


class _Step(ctypes.Structure):  # cpu_src/decode_layers.cpp: Step
    _fields_ = [
        *((name, _i32c) for name in _SIZES),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *((name, _ptr) for name in (*_ARRAYS, "block_tables", "context_lens", *_LORA)),
        *((name, _ptr) for name in ("group_slots", "group_tables")),
        *((name, _ptr) for name in ("cos_local", "sin_local", "branch")),
        ("softcap", ctypes.c_float),
        ("act", _i32c),
    ]


class _LoraPart(ctypes.Structure):  # cpu_src/decode_layers.cpp: LoraPart, one module's B
    _fields_ = [*((name, _i32c) for name in ("r0", "r1", "c0", "n")), ("b", _ptr)]


class _LoraAdapter(ctypes.Structure):  # LoraAdapter: one slot's A and B on one matrix
    _fields_ = [
        ("a", cpu_ops.Matrix),
        *((name, _i32c) for name in ("slot", "R", "n_parts", "pad")),
        ("parts", _ptr),
    ]


class _LoraMatrix(ctypes.Structure):  # LoraMatrix: the step's adapters on one matrix
    _fields_ = [("n", _i32c), ("pad", _i32c), ("adapters", _ptr)]


class _LoraLayer(ctypes.Structure):  # LoraLayer
    _fields_ = [(name[2:], _LoraMatrix) for name in _MATRICES]


class CpuBackend(NumpyBackend):
    name = "cpu"
    fuse_decode = True  # decode steps through cpu_src/decode_layers.cpp (False: the loop)

    def __init__(self, model_config: ModelConfig, weights: ModelWeights, engine_config):
        hd = model_config.head_dim
        if hd % 16 or hd > 256:  # the attention kernels take 16 head dims at a time
            raise NativeBuildError(
                f"the cpu backend's attention needs head_dim a multiple of 16 up to 256; "
                f"this model's is {hd} (--backend numpy runs it)"
            )
        library()  # build (once per source change) and load the kernels now, not mid-step
        threads()
        self._choices = {}  # (K, N) -> cpu_tuning.Choice: the layout kept and its times
        super().__init__(model_config, weights, engine_config, ops=cpu_ops)
        self._table, self._table_for = None, None  # decode_layers' layer pointers, their cache
        self._lora_native: dict = {}  # slot -> {(layer, matrix): (_LoraAdapter, its arrays)}
        self._lora_steps: dict = {}  # a step's adapters (slots) -> (_LoraLayer array, parts)
        self._scratch, self._scratch_for = None, None  # lora_add's scratch, its batch's slots

    def _quantization(self, asked: str | None) -> str | None:
        # a GGUF whose layer matrices are all Q8_0 keeps them so: quantizing its float32 values
        # again gives back the file's blocks bit for bit (tests/test_blocks.py), as it does
        # for Q4_0 and Q4_1 asked for by name (not by default: their activations in 8 bits
        # would move the bundled Q4_1 model's tokens off its float32 golden data)
        stored_q8_0 = asked is None and self.cfg.stored_matrix_type == "Q8_0"
        if stored_q8_0 and all(k % 32 == 0 for k, _ in self._matrix_shapes()):
            log.info("the GGUF's Q8_0 matrices are kept as Q8_0, as --quantization q8_0 would")
            return "q8_0"
        return asked

    def _matrix_store(self, quantization: str | None, head: bool = False):
        # a quantization -> its QuantWeight (the LM head's format for the head); bf16 values
        # (--dtype bfloat16) -> bf16 panels; int8 in panels too; float32 in panels or plain,
        # per shape as timed on this CPU (cpu_tuning). A matrix that is not whole panels
        # (width not a multiple of 16; bf16: an odd row count) keeps the plain layout.
        whole = lambda w: w.shape[1] % PANEL == 0  # noqa: E731
        if quantization is not None:
            kind = HEAD_FORMAT[quantization] if head else quantization
            if kind == "int8":
                return self._timed(lambda w: to_int8_panels(w) if whole(w) else quantize(w, kind))
            return self._timed(lambda w: quantize(w, kind))
        if self.kv_dtype == "bfloat16":
            bf16 = lambda w: to_bf16_panels(w) if whole(w) and w.shape[0] % 2 == 0 else to_bf16(w)  # noqa: E731
            return self._timed(bf16)
        return self._float32_store

    def _timed(self, store):
        """store, with the first matrix of each shape timed against NumPy's float32 product."""

        def keep(w: np.ndarray):
            kept = store(w)
            if w.shape not in self._choices:
                self._choices[w.shape] = cpu_tuning.measure_kept(kept, w)
            return kept

        return keep

    def _float32_store(self, w: np.ndarray):
        """A packed float32 matrix in the layout timed fastest for its shape (timed, or read
        from the measurements' file, the first time the shape comes)."""
        kept = keep_stored(w)  # a GGUF's k-quant matrices: the file's blocks
        if kept is not None:
            return kept
        w = np.ascontiguousarray(w, dtype=np.float32)  # the LM head comes as a view
        if w.shape not in self._choices:
            self._choices.update(cpu_tuning.choose({w.shape: w}))
        return to_panels(w) if self._choices[w.shape].layout == "panels" else w

    def _lora_store(self, m: np.ndarray):
        """An adapter's matrix in the float32 layout timed fastest for its shape."""
        return self._float32_store(m)

    # ---- LoRA: each adapter's rows through cpu_src/decode_layers.cpp lora_add ----
    def set_lora(self, slot: int, weights) -> None:
        super().set_lora(slot, weights)
        self._lora_native.pop(slot, None)
        self._scratch_for = None  # its rank may need wider scratch
        self._lora_steps = {k: v for k, v in self._lora_steps.items() if slot not in k}

    @property
    def lora_bytes(self) -> int:
        """Each slot's A packed and B row-major (lora_add's), each array once, those that are
        the loaded pairs' own arrays left out."""
        arrays = [e[1] for per in self._lora_native.values() for e in per.values() if e]
        kept = {id(a): a for a in _arrays(arrays)}
        for w in self.loras.values():
            for a in _arrays([list(layer.values()) for layer in w.layers]):
                kept.pop(id(a), None)
        return sum(int(a.nbytes) for a in kept.values())

    def _add_lora(self, y: np.ndarray, x: np.ndarray, layer: int, name: str, slots: np.ndarray):
        """y[rows] += each adapter's update of its rows (lora_add: gather, x @ A, each module's
        B into its columns), the same native code as the one-call decode, so the same bits."""
        m = getattr(self._lora_layers(self._lora_active(slots))[layer], name[2:])
        if m.n == 0:  # none of the step's adapters changes this matrix
            return
        xs, ts, rows = self._lora_scratch(slots)
        x, slots, p = cpu_ops._c32(x), cpu_ops._i32(slots), cpu_ops._p
        status = library().lora_add(
            p(y), p(x), ctypes.byref(m), p(slots), p(xs), p(ts), p(rows), x.shape[0],
            x.shape[1], y.shape[1], cpu_ops.threads(),
        )  # fmt: skip
        if status:
            raise ValueError(f"lora_add: shape {x.shape} is beyond the native kernels' limits")

    def _lora_active(self, slots: np.ndarray) -> tuple[int, ...]:
        """The slots a batch's rows run (the base model's -1 left out), once per batch."""
        return tuple(s for s, _ in self._lora_rows(slots))

    def _lora_scratch(self, slots: np.ndarray):
        """lora_add's scratch for a batch's rows (its ``lora_slots``): an adapter's rows of x,
        their x @ A, their indices; made once per batch, not once per product."""
        if self._scratch_for is not slots:
            T, c = len(slots), self.cfg
            R = max((w.rank for w in self.loras.values()), default=1)
            widest = max(c.hidden_size, c.q_dim, c.intermediate_size)
            self._scratch = (
                np.empty((T, widest), F32), np.empty((T, 3 * R), F32), np.empty(T, np.int32)
            )  # fmt: skip
            self._scratch_for = slots
        return self._scratch

    def _lora_adapter(self, slot: int, layer: int, name: str):
        """Slot's _LoraAdapter on one matrix, or None where the adapter leaves it alone: A kept
        as the weights are (packed), each module's B plain; made once per slot."""
        per = self._lora_native.setdefault(slot, {})
        if (layer, name) not in per:
            pair, entry = self.loras[slot].layers[layer].get(name), None
            if pair is not None and pair[1]:
                a = self._lora_store(pair[0])  # (K, R)
                bs = [np.ascontiguousarray(b, F32) for *_, b in pair[1]]  # (r, n) each
                parts = (_LoraPart * len(bs))(
                    *(_LoraPart(r0, r1, c0, b.shape[1], cpu_ops._p(b))
                      for (r0, r1, c0, _), b in zip(pair[1], bs, strict=True))
                )  # fmt: skip
                ad = _LoraAdapter(cpu_ops.matrix(a), slot, pair[0].shape[1], len(bs), 0)
                ad.parts = ctypes.cast(parts, _ptr)
                entry = (ad, (a, bs, parts))
            per[(layer, name)] = entry
        return per[(layer, name)]

    def _lora_layers(self, active: tuple[int, ...]):
        """The step's _LoraLayer array: per layer and matrix, the adapters of ``active`` that
        change it. Kept for the last few sets of adapters."""
        if active not in self._lora_steps:
            if len(self._lora_steps) >= 8:
                self._lora_steps.pop(next(iter(self._lora_steps)))
            layers, keep = (_LoraLayer * len(self.layers))(), []
            for i in range(len(self.layers)):
                for name in _MATRICES:
                    found = [self._lora_adapter(s, i, name) for s in active]
                    arr = (_LoraAdapter * len(active))(*(e[0] for e in found if e is not None))
                    n = sum(e is not None for e in found)
                    setattr(layers[i], name[2:], _LoraMatrix(n, 0, ctypes.cast(arr, _ptr)))
                    keep.append(arr)
            self._lora_steps[active] = (layers, keep)
        return self._lora_steps[active][0]

    def _stored(self) -> None:
        self.products_vs_numpy = None  # the kept products' time over NumPy's float32 ones
        arrays = [self.embed, self.final_norm, self.lm_head]
        arrays += [a for lw in self.layers for a in lw.arrays()]
        kinds = sorted(bytes_by_kind(arrays).items(), key=lambda kv: -kv[1])
        log.info(
            "weights resident, by format: %s",
            ", ".join(f"{kind} {n / 2**20:.1f} MiB" for kind, n in kinds),
        )
        if self._choices:
            line, self.products_vs_numpy = cpu_tuning.summary(self._choices)
            log.info(
                "products, by shape (K x N) as timed on this CPU (once, kept in %s): %s",
                cpu_tuning.cache_file(),
                line,
            )

    def forward_greedy(self, batch: ForwardBatch) -> np.ndarray:
        """greedy_ids' answer (first maximum, NaN never wins, -1 with nothing above -inf) in one
        native pass over the logits."""
        return cpu_ops.argmax_rows(self._logits(batch))

    def _rotary_cache(self, qkv, lw: PackedLayer, k_cache, v_cache, b: ForwardBatch, rope):
        # qkv (T, H*hd + 2*Hkv*hd) -> rotated q (T, H, hd); k, v rotated and cached, one pass
        c, bias, q_norm, k_norm = self.cfg, lw.b_qkv, lw.q_norm, lw.k_norm
        if c.qk_norm_whole or c.clip_qkv is not None:  # OLMoE's steps first, here
            qkv = self._olmoe_qkv(qkv if bias is None else qkv + bias, lw)
            bias, q_norm, k_norm = None, None, None
        return self.ops.rotary_cache(
            qkv, b.positions, rope, k_cache, v_cache, b.slot_mapping, c.num_attention_heads,
            bias, q_norm, k_norm, c.rms_norm_eps,
        )  # fmt: skip

    # ---- every layer of a decode step in one native call ----
    def _run_layers(self, x: np.ndarray, residual: np.ndarray | None, batch: ForwardBatch):
        """A step whose sequences bring at most SHORT_RUN tokens each (decodes, speculative
        verifies: the last token and its drafts; SiLU models) runs cpu_src/decode_layers.cpp:
        the same kernels in the same order as the loop it replaces, one ctypes call instead of
        about ten a layer, each token's attention a decode of its own (``_token_tables``), LoRA
        rows' updates after each product, a layer of experts routed and run natively
        (engine/backends/cpu_experts.py), Gemma 2 and 3's sandwich norms, soft-capping,
        local RoPE and GELU. Anything else (a shared expert, gpt-oss, OLMoE) takes the NumPy
        backend's loop. KV groups: each layer reads its slot through its group's slots and
        tables (``_group_arrays``)."""
        c = self.cfg  # decode_layers has no OLMoE q/k norms, clip_qkv or sinks
        plain = c.hidden_act in cpu_ops.NATIVE_ACTS and not c.qk_norm_whole and c.clip_qkv is None
        fused = self.fuse_decode and residual is None and plain and self._layer_experts()
        if fused and _short_runs(batch):
            return self._decode_layers(x, batch)
        return super()._run_layers(x, residual, batch)

    def _attend(self, q, k_cache, v_cache, b: ForwardBatch, window: int, sinks=None):
        """The loop's attention, as decode_layers runs it: every token of a batch of short
        runs a decode of its own; otherwise decodes and prefills as the NumPy backend splits
        them."""
        if not _short_runs(b):
            return super()._attend(q, k_cache, v_cache, b, window, sinks)
        tables, lens = self._token_tables(b)  # (T, max_blocks), (T,)
        return self.ops.paged_attention_decode(
            q, k_cache, v_cache, tables, lens, self.scale, window, self.softcap, sinks
        )  # (T, H, hd)

    @staticmethod
    def _token_tables(b: ForwardBatch) -> tuple[np.ndarray, np.ndarray]:
        """((T, max_blocks) page tables, (T,) context lengths) with a row per token: its
        sequence's table and its position + 1, the keys a causal query at that position sees
        once the step's K and V are written (the step writes them before any attention). A
        batch of decodes is its own."""
        if b.num_tokens == b.num_seqs:
            return b.block_tables, b.context_lens
        seq = np.repeat(np.arange(b.num_seqs), np.diff(b.query_start_loc))  # (T,) each token's
        return b.block_tables[seq], b.positions + 1

    def _layer_table(self):
        """The layers' pointers for decode_layers, made once per KV cache (KV groups: each
        layer's slot and group)."""
        cache, p, groups = self.kv_cache, cpu_ops._p, self.kv_groups
        if self._table_for is not cache:
            table = (_Layer * len(self.layers))()
            for i, lw in enumerate(self.layers):
                slot, g = (
                    (i, 0) if groups is None else (groups.layer_slot[i], groups.layer_group[i])
                )
                ex = self._layer_experts()[i]
                table[i] = _Layer(
                    p(lw.attn_norm), p(lw.mlp_norm), p(lw.b_qkv), p(lw.q_norm), p(lw.k_norm),
                    p(cache[slot, 0]), p(cache[slot, 1]), self.cfg.window(i), g,
                    cpu_ops.matrix(lw.w_qkv), cpu_ops.matrix(lw.w_o),
                    cpu_ops.matrix(lw.w_gate_up), cpu_ops.matrix(lw.w_down),
                    None if ex is None else ctypes.addressof(ex),
                    p(lw.post_attn_norm), p(lw.post_mlp_norm),
                    int(bool(self.cfg.local_rope and self.cfg.window(i))),
                )  # fmt: skip
            self._table, self._table_for = table, cache
        return self._table

    def _layer_experts(self) -> list | None:
        """Per layer its Experts for decode_layers (None: a dense layer), made once; None
        (falsy) when a layer of experts cannot run there."""
        if not hasattr(self, "_experts_table"):
            act = self.cfg.hidden_act
            table = [lw.experts and native_experts(lw.experts, act) for lw in self.layers]
            ok = all(t is not None for t, lw in zip(table, self.layers, strict=True) if lw.experts)
            self._experts_table = table if ok else None
        return self._experts_table

    def _group_arrays(self, b: ForwardBatch):
        """KV groups: (what must live through the call, (pointers to each later group's (T,)
        slots, to its (T, max_blocks) token tables)); ([], (None, None)) with one group."""
        if not b.group_tables:
            return [], (None, None)
        views = [
            b.for_layer(self.kv_groups.layers[g][0])[1]
            for g in range(1, len(self.kv_groups.layers))
        ]
        slots = [cpu_ops._i32(v.slot_mapping) for v in views]  # (T,) each
        tables = [cpu_ops._i32(self._token_tables(v)[0]) for v in views]  # (T, max_blocks) each
        n = len(views)
        ptrs = ((_ptr * n)(*map(cpu_ops._p, slots)), (_ptr * n)(*map(cpu_ops._p, tables)))
        return [slots, tables, ptrs], tuple(ctypes.cast(a, _ptr) for a in ptrs)

    def _decode_layers(self, x: np.ndarray, b: ForwardBatch):
        c, t = self.cfg, len(b.token_ids)
        x = cpu_ops._c32(x)  # (T, D), becomes the last layer's output
        cos, sin = map(cpu_ops._c32, fast_ops._cos_sin(b.positions, c.head_dim, c.rope, F32))
        tables, lens = map(cpu_ops._i32, self._token_tables(b))  # (T, max_blocks), (T,)
        slots = cpu_ops._i32(b.slot_mapping)
        qkv_dim = c.q_dim + 2 * c.kv_dim
        arrays = {
            "x": x,
            "residual": np.empty_like(x),
            "h": np.empty_like(x),
            "qkv": np.empty((t, qkv_dim), F32),
            "q": np.empty((t, c.q_dim), F32),
            "attn": np.empty((t, c.q_dim), F32),
            "gate_up": np.empty((t, 2 * c.intermediate_size), F32),
            "act_out": np.empty((t, c.intermediate_size), F32),
            "cos": cos,
            "sin": sin,
            "slots": slots,
        }
        sizes = (
            t, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size, self.block_size, tables.shape[1],
            cpu_ops._cache_code(self.kv_cache), cpu_ops.threads(),
        )  # fmt: skip
        lora = [None] * len(_LORA)
        if b.lora_slots is not None:
            lora_slots = cpu_ops._i32(b.lora_slots)
            arrays["lora_slots"] = lora_slots
            table = self._lora_layers(self._lora_active(b.lora_slots))
            scratch = self._lora_scratch(b.lora_slots)
            lora = [ctypes.cast(table, _ptr), *map(cpu_ops._p, (lora_slots, *scratch))]
        keep, group_ptrs = self._group_arrays(b)  # keep: the arrays behind the pointers
        local = (None, None)  # Gemma 3's sliding layers' own RoPE
        if c.local_rope:
            local = fast_ops._cos_sin(b.positions, c.head_dim, c.local_rope, F32)
            local = tuple(map(cpu_ops._c32, local))
        branch = np.empty_like(x) if c.sandwich_norms else None  # (T, D)
        step = _Step(
            *sizes, c.rms_norm_eps, self.scale,
            *(cpu_ops._p(arrays[name]) for name in _ARRAYS), cpu_ops._p(tables),
            cpu_ops._p(lens), *lora, *group_ptrs, *map(cpu_ops._p, (*local, branch)),
            self.softcap, cpu_ops.NATIVE_ACTS[c.hidden_act],
        )  # fmt: skip
        table = self._layer_table()
        status = library().decode_layers(table, len(table), ctypes.byref(step))
        if status:
            raise ValueError(f"decode_layers: shape {x.shape} is beyond the native kernels' limits")
        return x, arrays["residual"]
