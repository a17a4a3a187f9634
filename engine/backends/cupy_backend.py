"""The GPU backend: weights and the KV pool in device memory, every op a ``cuda_src`` kernel.

One class, written over a device (``engine.devices.device``) and its array module ``xp``:

    CupyDevice      backend ``cuda``: CuPy on a GPU, kernels through ``cupy.RawModule``, cuBLAS
                    on the device's own handle, CUDA graphs for decode, pinned swap space
    EmulatedDevice  backend ``cuda-cpu``: the same code on the host, the kernels' CPU builds,
                    cuBLAS emulated on raw memory, graphs replayed under CUDA's and CuPy's
                    capture rules, so every CI run runs this class end to end

A step uploads its metadata in one copy, runs the layers into a workspace allocated once per
step (reused by every layer), and downloads float32 logits (B, V) (``forward``), or only the
(B,) greedy ids, argmax on the device (``forward_greedy``). Pure-decode steps of up to
``max_num_seqs`` sequences replay a graph captured for the next batch size up, argmax included
(the ids in a buffer of the graphs', so a greedy step launches nothing after the replay); the
padding rows write no KV (slot -1) and read one cached token (context length 1).

``launch_greedy`` (async scheduling) queues the same step without waiting: the tokens the batch
takes from the step before are gathered on the device from that step's ids, and the ids are
copied to pinned host memory behind an event that the handle's ``result()`` waits for. The graph
inputs' pinned staging buffer alternates between two, so the next step's inputs are written while
the last one's copy may still be queued.

Its parts, one job each: cupy_step.py (a layer's weights, a step's inputs and workspace),
cupy_lora.py (the LoRA slots), cupy_memory.py (the memory accounting the pool is sized from),
cuda_graphs.py (the decode graphs), cupy_blocks.py (a GGUF's matrices kept in their blocks on
the device, and ``BlockGemm``, the products over every weight).

Per layer: one QKV product into (T, q_dim + 2 kv_dim) rows, ``rotary_cache`` (q rotated into
the attention's (T, H, hd) buffer, k rotated and v written into the paged cache), attention,
the output product, ``fused_add_rms_norm``, one gate-up product, ``act_and_mul``, the down
product, ``fused_add_rms_norm``.
"""

from __future__ import annotations

import functools
import logging
import time

import numpy as np

from engine.backends.base import Backend, GreedyIds, block_pairs, numpy_dtype, resolve_kv_dtype
from engine.backends.cuda_graphs import DecodeGraphs
from engine.backends.cupy_blocks import BlockGemm
from engine.backends.cupy_lora import LoRASlots
from engine.backends.cupy_memory import DeviceMemory
from engine.backends.cupy_moe import experts_forward
from engine.backends.cupy_step import (
    DeviceLayer,
    StepInputs,
    Workspace,
    on_device,
    pack_inputs,
    split_inputs,
)
from engine.backends.cupy_weights import DeviceWeights
from engine.backends.forward_batch import ForwardBatch
from engine.devices.device import CupyDevice, PendingDownload, raw_view
from engine.kernels.launch import lora_tiles
from engine.utils import MiB
from model_loader.rope import rope_table
from model_loader.weights import ModelWeights

log = logging.getLogger("engine.backend")


class CupyBackend(DeviceWeights, DeviceMemory, LoRASlots, DecodeGraphs, Backend):
    """Paged-attention forward on a device. ``kv_cache``: (L, 2, N, bs, Hkv, hd) on the device
    (a grouped model's: G slots for L); ``cpu_cache``: (L, 2, N_cpu, bs, Hkv, hd) in pinned
    host memory."""

    supports_kv_groups = True

    def __init__(self, model_config, weights: ModelWeights, engine_config, device=None):
        self.device = device if device is not None else CupyDevice()
        self.name = "cuda" if self.device.is_gpu else "cuda-cpu"
        self.xp, self.k = self.device.xp, self.device.kernels
        self.gemm = BlockGemm(self.device.gemm, self.k, self.device.empty)  # GGUF blocks too
        self.cfg = c = model_config
        self.block_size = engine_config.block_size
        self.kv_dtype = resolve_kv_dtype(engine_config.dtype, model_config, self.device.is_gpu)
        self.dtype = numpy_dtype(self.kv_dtype)
        self.max_model_len = engine_config.max_model_len or c.max_position_embeddings
        self.max_num_seqs = engine_config.max_num_seqs
        limit = self.device.graph_batch_limit  # None on a GPU: every batch size up to the max
        self.max_graph_batch = min(self.max_num_seqs, limit or self.max_num_seqs)
        self.use_graphs = not engine_config.enforce_eager
        self.scale = c.attn_scale  # q.k's factor
        self.softcap = c.attn_softcap  # scores soft-capped at it (0: not)
        # Gemma's sqrt(D) rounded to the activations' dtype, as Hugging Face rounds it
        self.embed_scale = float(self.dtype.type(c.embed_scale))
        windows = [c.window(i) for i in range(c.num_hidden_layers)]
        self.split_window = 0 if 0 in windows else max(windows)  # sizes the decode split
        self.logits_cols = c.vocab_size  # the LM head's output columns (a rank's: its slice)
        self.kv_cache = self.cpu_cache = None
        self.graphs: dict[int, object] = {}
        # LoRA (enable_lora): max_loras slots of up to max_lora_rank, in device memory
        self.lora_shape = (
            (engine_config.max_loras, engine_config.max_lora_rank)
            if engine_config.enable_lora
            else None
        )
        self._startup(weights)

    # ---- startup ----
    @on_device
    def _startup(self, weights: ModelWeights) -> None:
        t0 = time.perf_counter()
        self.device.compile_kernels({"HEAD_DIM": self.cfg.head_dim, "BLOCK_SIZE": self.block_size})
        t1 = time.perf_counter()
        log.info("backend %s: CupyBackend on %s", self.name, self.device.name)
        log.info("kernels for %s compiled in %.2f s", self.device.name, t1 - t0)
        self._upload_weights(weights)
        self._allocate_lora()

        rows = max(self.max_model_len, 1)
        c = self.cfg
        self.cos_sin = self.device.upload(rope_table(rows, c.head_dim, c.rope))
        # Gemma 3's sliding layers' own table, else the same
        local = c.local_rope
        self.cos_sin_local = (
            self.device.upload(rope_table(rows, c.head_dim, local)) if local else self.cos_sin
        )
        self.device.synchronize()
        log.info(
            "weights on %s: %s as %s in %.2f s",
            self.device.name,
            f"{self.weights_bytes / MiB:,.1f} MiB",
            self.kv_dtype,
            time.perf_counter() - t1,
        )

    # ---- cache ----
    @on_device
    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        """The block pool on the device (zeroed), swap blocks in pinned host memory; then the
        decode graphs, which need the pool."""
        self.kv_cache = self.device.zeros(self.cache_shape(num_blocks), self.dtype)
        self.cpu_cache = self.device.pinned_empty(self.cache_shape(num_cpu_blocks), self.dtype)
        if self.use_graphs:
            self._capture_graphs()

    @on_device
    def swap_out(self, pairs) -> None:
        """Device-pool block -> CPU-pool block, for each (gpu, cpu)."""
        g, c = block_pairs(pairs)
        if len(g):
            rows = self.xp.take(raw_view(self.kv_cache), self.device.upload(g), axis=2)
            raw_view(self.cpu_cache)[:, :, c] = self.device.download(rows)

    @on_device
    def swap_in(self, pairs) -> None:
        """CPU-pool block -> device-pool block, for each (cpu, gpu)."""
        c, g = block_pairs(pairs)
        if len(c):
            rows = self.device.upload(raw_view(self.cpu_cache)[:, :, c])  # (L, 2, n, bs, Hkv, hd)
            raw_view(self.kv_cache)[:, :, self.device.upload(g)] = rows

    @property
    def block_dtype(self) -> np.dtype:
        """``read_blocks``' dtype: the pool's raw view (16-bit floats as their bits)."""
        return np.dtype(raw_view(self.kv_cache).dtype.name)

    @on_device
    def read_blocks(self, ids, groups=None) -> np.ndarray:
        """(L, 2, n, bs, Hkv, hd) pool blocks ``ids`` on the host, in ``block_dtype`` (a
        synchronous download on the compute stream; the KV tiers store them)."""
        idx = self.device.upload(np.asarray(ids, dtype=np.int32))
        return self.device.download(self.xp.take(raw_view(self.kv_cache), idx, axis=2))

    @on_device
    def write_blocks(self, ids, data: np.ndarray, groups=None) -> None:
        """Pool blocks ``ids`` = ``data`` as ``read_blocks`` gave them (a KV tier's load)."""
        idx = self.device.upload(np.asarray(ids, dtype=np.int32))
        raw_view(self.kv_cache)[:, :, idx] = self.device.upload(np.ascontiguousarray(data))

    @on_device
    def copy_blocks(self, pairs) -> None:
        """Copy-on-write: whole blocks within the device pool, for each (src, dst)."""
        pairs = np.asarray(pairs, np.int32).reshape(-1, 2)  # (P, 2)
        if not len(pairs):
            return
        if np.intersect1d(pairs[:, 0], pairs[:, 1]).size:
            raise ValueError("copy_blocks: a block is both a source and a destination")
        self.k.copy_blocks(self.kv_cache, self.kv_cache, self.device.upload(pairs))

    # ---- forward ----
    @on_device
    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """One step over the flattened batch -> (B, V) float32 logits on the host."""
        return self.device.download(self._logits(batch))

    @on_device
    def forward_greedy(self, batch: ForwardBatch) -> np.ndarray:
        """One step -> (B,) int32 argmax of each row (first maximum), by the ``sample_greedy``
        kernel on the device's logits (inside the graph on a replay): only the B ids come to
        the host. ``launch_greedy``, waited for."""
        return self.launch_greedy(batch).result()

    @on_device
    def launch_greedy(self, batch: ForwardBatch, prev: GreedyIds | None = None) -> DeviceIds:
        """Queue one greedy step on the stream and return at once: a handle whose ``result()``
        waits for the (B,) ids. Tokens that ``batch.prev_rows`` names come from ``prev``'s ids,
        on the device."""
        R = len(batch.output_rows)
        take = None
        if batch.prev_rows is not None:
            take = functools.partial(self._take_prev, batch.prev_rows, prev.device_ids)
        if self._fits_graph(batch):
            self._replay(batch, take)
            ids = self._graph_ids[:R]  # (B,) read by the copy below, before the next replay
        else:
            logits = self._run_eager(batch, take)  # (R, V)
            ids = self.device.empty(R, np.int32)  # (R,)
            self.k.sample_greedy(ids, logits)
        return DeviceIds(ids, self.device.download_async(ids))

    def _take_prev(self, rows: np.ndarray, prev_ids, tokens) -> None:
        """tokens[i] = prev_ids[rows[i]] (at least 0) on the device, for each rows[i] >= 0."""
        rows = np.asarray(rows, np.int32)  # (T,)
        at = np.flatnonzero(rows >= 0).astype(np.int32)  # (n,)
        if len(at):
            pairs = self.device.upload(np.stack([at, rows[at]]))  # (2, n)
            # a failed row's -1 becomes 0: its sequence ends when the ids are read
            tokens[pairs[0]] = self.xp.maximum(prev_ids[pairs[1]], 0)

    def _fits_graph(self, batch: ForwardBatch) -> bool:
        B = batch.num_seqs  # a step with LoRA rows runs eagerly
        pure = batch.num_decodes == B and batch.lora_slots is None
        return bool(self.graphs) and pure and B <= max(self.graphs)

    def _logits(self, batch: ForwardBatch):
        """(B, V) float32 logits on the device: a graph replay for a pure-decode step that fits
        one, else the eager step."""
        return self._replay(batch) if self._fits_graph(batch) else self._run_eager(batch)

    def _run_eager(self, batch: ForwardBatch, take=None):
        """``take(tokens)``: fills the uploaded token ids that come from the step before."""
        T, R, nd = batch.num_tokens, len(batch.output_rows), batch.num_decodes
        inputs = self._upload_inputs(batch)
        if take is not None:
            take(inputs.token_ids)
        max_ctx = int(batch.context_lens[:nd].max()) if nd else 1
        return self._step(inputs, T, R, nd, max_ctx)

    def _upload_inputs(self, batch: ForwardBatch):
        """The step's inputs in one upload (engine/backends/cupy_step.py), with its LoRA rows'
        tiles and the slots they run where it has any."""
        T, B, nd = batch.num_tokens, batch.num_seqs, batch.num_decodes
        lora = None if batch.lora_slots is None else lora_tiles(batch.lora_slots)
        flat = self.device.upload(pack_inputs(batch, lora))
        tiles = None if lora is None else lora[1].shape[0]
        R = len(batch.output_rows)
        M, groups = batch.block_tables.shape[1], len(batch.group_slots)
        inputs = split_inputs(flat, T, B, nd, M, R, tiles, groups)
        inputs.kv_groups = batch.kv_groups
        if lora is not None:  # the slots the step's rows run
            inputs.lora += (set(np.unique(batch.lora_slots[batch.lora_slots >= 0]).tolist()),)
        return inputs

    def _workspace(self, T: int, B: int) -> Workspace:
        c, dt = self.cfg, self.dtype
        H, Hkv, hd, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
        F = c.intermediate_size

        def empty(*shape, dtype=dt):
            return self.device.empty(shape, dtype)

        return Workspace(
            residual=empty(T, D),
            x=empty(T, D),
            h=empty(T, D),
            qkv=empty(T, (H + 2 * Hkv) * hd),
            q=empty(T, H, hd),
            attn=empty(T, H, hd),
            gate_up=empty(T, 2 * F),
            act=empty(T, F),
            last_x=empty(B, D),
            last_res=empty(B, D),
            last_h=empty(B, D),
            logits=empty(B, self.logits_cols, dtype=np.float32),
            branch=empty(T, D) if c.sandwich_norms else None,
        )

    def _step(self, inp: StepInputs, T: int, R: int, nd: int, max_ctx: int):
        """The layers over a step's inputs -> (R, V) float32 logits on the device, R output
        rows (one per sequence, or every row of a speculated run). No host synchronisation, so
        a graph can capture it."""
        ws = self._layers(inp, T, R, nd, max_ctx)
        k, c = self.k, self.cfg
        eps, off = c.rms_norm_eps, c.norm_offset
        x, res = ws.x, ws.residual
        if inp.rows is not None:  # only each sequence's last token (a run's rows) is sampled
            self.xp.take(raw_view(ws.x), inp.rows, axis=0, out=raw_view(ws.last_x))
            self.xp.take(raw_view(ws.residual), inp.rows, axis=0, out=raw_view(ws.last_res))
            x, res = ws.last_x, ws.last_res  # (B, D)
        k.fused_add_rms_norm(ws.last_h, res, x, self.final_norm, eps, off)  # (B, D)
        return self._final_softcap(self._lm_head(ws))  # (B, V) float32

    def _final_softcap(self, logits):
        """(R, V) float32 logits soft-capped in place where the model says so (Gemma 2)."""
        cap, xp = self.cfg.final_softcap, self.xp
        if cap:
            xp.divide(logits, np.float32(cap), out=logits)
            xp.tanh(logits, out=logits)
            xp.multiply(logits, np.float32(cap), out=logits)
        return logits

    def _layers(self, inp: StepInputs, T: int, R: int, nd: int, max_ctx: int) -> Workspace:
        """Every layer over a step's inputs: the workspace, its ``x`` the last layer's output
        and ``residual`` the stream before it (the final norm adds them)."""
        k, c, ws = self.k, self.cfg, self._workspace(T, R)
        eps, off = c.rms_norm_eps, c.norm_offset  # norms scale by (off + w): Gemma's 1 + w
        self._embed(ws.residual, inp.token_ids)  # (T, D)
        k.rms_norm(ws.h, ws.residual, self.layers[0].attn_norm, eps, off)
        for i, lw in enumerate(self.layers):
            if i:  # residual += previous MLP output; h = norm(residual)
                k.fused_add_rms_norm(ws.h, ws.residual, ws.x, lw.attn_norm, eps, off)
            self._attention(ws, lw, i, inp, nd, max_ctx)  # -> ws.x (T, D)
            x = ws.x
            if lw.post_attn_norm is not None:  # sandwich: the attention's output normalised
                k.rms_norm(ws.branch, ws.x, lw.post_attn_norm, eps, off)
                x = ws.branch
            k.fused_add_rms_norm(ws.h, ws.residual, x, lw.mlp_norm, eps, off)
            post = lw.post_mlp_norm
            out = ws.x if post is None else ws.branch
            self._mlp(ws, lw, i, inp, out)  # (T, D)
            self._reduce(out)
            if post is not None:  # the MLP's output normalised, into ws.x
                k.rms_norm(ws.x, ws.branch, post, eps, off)
        return ws

    def _mlp(self, ws: Workspace, lw: DeviceLayer, i: int, inp, out) -> None:
        """ws.h (T, D) normed -> out (T, D): the gated MLP, or a layer of experts."""
        if lw.experts is not None:
            experts_forward(self.k, self.gemm, self.device.empty, lw.experts, ws.h, out,
                            self.cfg.hidden_act, inp.slot_mapping)  # fmt: skip
            return
        self._gemm(ws.h, lw, i, "w_gate_up", ws.gate_up, inp)  # (T, 2F)
        self.k.act_and_mul(ws.act, ws.gate_up, self.cfg.hidden_act)  # (T, F)
        self._gemm(ws.act, lw, i, "w_down", out, inp)  # (T, D)

    def expert_tokens(self) -> list[list[int]] | None:
        """Per layer of experts: [its index, then the rows routed to each expert so far]."""
        rows = [[i, *self.device.download(lw.experts.totals).tolist()]
                for i, lw in enumerate(self.layers) if lw.experts is not None]  # fmt: skip
        return rows or None

    @on_device
    def hidden_states(self, batch: ForwardBatch) -> np.ndarray:
        """(T, D) float32 on the host: every row's last hidden state after the final norm (the
        pooling runner); eager, as a prefill step is."""
        T, nd = batch.num_tokens, batch.num_decodes
        inp = self._upload_inputs(batch)
        max_ctx = int(batch.context_lens[:nd].max()) if nd else 1
        ws = self._layers(inp, T, 1, nd, max_ctx)
        c = self.cfg
        out = self.device.empty((T, c.hidden_size), self.dtype)  # (T, D)
        self.k.fused_add_rms_norm(out, ws.residual, ws.x, self.final_norm, c.rms_norm_eps,
                                  c.norm_offset)  # fmt: skip
        return self.device.download(out).astype(np.float32)

    @on_device
    def head_logits(self, h: np.ndarray) -> np.ndarray:
        """(R, D) final-normed hidden states -> (R, V) float32 logits (a reranker's rows)."""
        x = self.device.upload(np.ascontiguousarray(h, dtype=self.dtype))
        out = self.device.empty((h.shape[0], self.logits_cols), np.float32)
        self.gemm(x, self.lm_head, out)
        return self.device.download(self._final_softcap(out))

    # What a tensor-parallel rank (``engine.executor.rank_cupy``) does across its ranks.
    def _embed(self, out, token_ids) -> None:
        self.k.embedding(out, token_ids, self.embed, self.embed_scale)  # (T, D)

    def _reduce(self, x) -> None:
        """The sum over the ranks of a row-sharded product's partial output: one rank, as is."""

    def _lm_head(self, ws: Workspace):
        self.gemm(ws.last_h, self.lm_head, ws.logits)  # (B, V) float32
        return ws.logits

    def _attention(self, ws: Workspace, lw: DeviceLayer, layer: int, inp, nd: int, max_ctx):
        # ws.h (T, D) normalized -> ws.x (T, D)
        k, T, qd = self.k, ws.h.shape[0], self.cfg.q_dim
        self._gemm(ws.h, lw, layer, "w_qkv", ws.qkv, inp)  # (T, H*hd + 2*Hkv*hd)
        slot, slots, tables = inp.for_layer(layer)  # KV groups: its slot, its group's tables
        c, q_norm, k_norm = self.cfg, lw.q_norm, lw.k_norm
        if c.qk_norm_whole or c.clip_qkv is not None:  # OLMoE: q, k normed as wholes; a clamp
            whole = (q_norm, k_norm) if c.qk_norm_whole else ()
            k.olmoe_qkv(ws.qkv, c.q_dim, c.kv_dim, *whole, eps=c.rms_norm_eps, clip=c.clip_qkv)
            q_norm = k_norm = None
        k_cache, v_cache = self.kv_cache[slot, 0], self.kv_cache[slot, 1]  # (N, bs, Hkv, hd)
        k.rotary_cache(
            ws.q,
            k_cache,
            v_cache,
            ws.qkv,
            inp.positions,
            slots,
            self.cos_sin_local if self.cfg.window(layer) else self.cos_sin,  # Gemma 3's kinds
            bias=lw.b_qkv,
            q_norm=q_norm,
            k_norm=k_norm,
            eps=self.cfg.rms_norm_eps,
        )
        B, window = inp.context_lens.shape[0], self.cfg.window(layer)
        if nd:  # decodes: rows 0..nd-1, one per sequence
            k.paged_attention_decode(
                ws.attn[:nd],
                ws.q[:nd],
                k_cache,
                v_cache,
                tables[:nd],
                inp.context_lens[:nd],
                self.scale,
                max_ctx,
                window=window,
                softcap=self.softcap,
                sinks=lw.sinks,
            )
        if nd < B:  # prefills: the rows after the decodes
            k.paged_attention_prefill(
                ws.attn[nd:],
                ws.q[nd:],
                k_cache,
                v_cache,
                tables[nd:],
                inp.prefill_qsl,
                inp.context_lens[nd:],
                self.scale,
                window=window,
                softcap=self.softcap,
                sinks=lw.sinks,
            )
        self._gemm(ws.attn.reshape(T, qd), lw, layer, "w_o", ws.x, inp)  # (T, D)
        self._reduce(ws.x)
        if lw.b_o is not None:  # gpt-oss: after the ranks' sum, once
            k.add_bias(ws.x, lw.b_o)


class DeviceIds(GreedyIds):
    """A queued greedy step: its ids on the device (for the next step's tokens) and their copy
    to the host in flight."""

    def __init__(self, device_ids, download: PendingDownload):
        self.device_ids = device_ids  # (B,) on the device
        self.download = download
        self.ids = None

    def result(self) -> np.ndarray:
        if self.ids is None:
            self.ids = self.download.wait()
        return self.ids


def cuda_backend(model_config, weights, engine_config, emulate: bool = False) -> CupyBackend:
    """``cuda`` on the first GPU (ValueError when CuPy finds none), or with ``emulate``,
    ``cuda-cpu``: the same backend on the emulated device."""
    from engine.devices.device import gpu_status

    if emulate:
        from engine.emulation.device import EmulatedDevice

        return CupyBackend(model_config, weights, engine_config, device=EmulatedDevice())
    n, why = gpu_status()
    if n == 0:
        raise ValueError(f"backend 'cuda' needs a GPU that CuPy can see; none was found ({why})")
    return CupyBackend(model_config, weights, engine_config)
