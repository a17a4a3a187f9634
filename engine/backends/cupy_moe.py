"""A layer of experts on the GPU backend: its weights on the device (``upload_experts``) and its
step (``experts_forward``), every part a cuda_src kernel (engine/kernels/moe_launch.py).

Per step and layer, T tokens and P = T * k pairs:
  moe_route    h (T, D) -> each token's top k experts and weights (T, k): the router in float32
               (never quantized), softmax, top k by probability (equal ones: the lower index),
               renormalized where the family says; Qwen2-MoE's shared gate sigmoid(h . w_s)
  moe_align    the pairs bucketed by expert: offsets (E + 1,), sorted pairs (P,), each pair's
               position; each expert's count added to its running total (``expert_tokens``),
               rows without a KV slot (a graph's padding, the profile step) not counted
  moe_matmul   gate|up: each pair's token row through its expert, (P, 2F) in sorted order (+ its
               bias: gpt-oss); act(gate) * up, or gpt-oss's clamped SwiGLU, (P, F); down: (P, D)
               float32 (+ bias); an expert's weights read once per 16 of its rows
  moe_combine  out (T, D) = each token's k rows times their weights, plus the shared expert
Nothing waits for the host, so the decode graphs capture these steps as they do the dense MLP's.
Expert weights are the activations' dtype, or MXFP4 blocks as stored (gpt-oss); a GGUF's other
block formats are widened at load (a startup line says so): ``moe_matmul`` reads no other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from engine.backends.cupy_blocks import bytes_by_format
from model_loader.gguf_blocks import ExpertBlocks

log = logging.getLogger("engine.backend")
F32 = np.dtype(np.float32)


@dataclass
class DeviceExperts:
    """One layer of experts on the device."""

    router: object  # (E, D) float32, or (E + 1, D): the last row a shared expert's gate
    gate_up: object  # (E, 2F, D): gate | up rows, in the dtype or MXFP4 (E, 2F, D/32*17) uint8
    down: object  # (E, D, F), likewise
    fmt: str  # "dtype" or "mxfp4": the two matrices' format (moe_matmul's fmt)
    top_k: int
    renormalize: bool
    totals: object  # (E,) uint64: rows routed to each expert so far
    shared: tuple | None = None  # Qwen2-MoE: (2Fs, D) gate|up and (D, Fs) down, dense matrices
    biases: tuple | None = None  # gpt-oss, float32: (E,) router, (E, 2F) gate|up, (E, D) down
    clamp: tuple | None = None  # gpt-oss's (alpha, limit): clamped SwiGLU instead of ``act``

    @property
    def num_experts(self) -> int:
        return int(self.gate_up.shape[0])

    @property
    def intermediate_size(self) -> int:
        return int(self.gate_up.shape[1]) // 2

    def arrays(self) -> list:
        return [self.router, self.gate_up, self.down, *(self.shared or ()), *(self.biases or ())]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays())

    def bytes_by_kind(self) -> dict[str, int]:
        kinds = bytes_by_format([self.router, *(self.shared or ()), *(self.biases or ())])
        for m in (self.gate_up, self.down):
            kind = "mxfp4" if self.fmt == "mxfp4" else m.dtype.name
            kinds[kind] = kinds.get(kind, 0) + int(m.nbytes)
        return kinds


def _stacked(parts, dtype, widened: set) -> tuple[np.ndarray, str]:
    """An expert matrix's parts (E, N_i, K) joined along N -> ((E, N, K) in ``dtype``, "dtype"),
    or, when every part is MXFP4 kept as stored, ((E, N, K/32*17) uint8, "mxfp4"). A part in
    another block format is widened (its type name added to ``widened``)."""
    if all(isinstance(p, ExpertBlocks) and p.as_stored and p.qtype.name == "MXFP4" for p in parts):
        raws = [p.raw.reshape(p.shape[0], p.shape[1], -1) for p in parts]  # (E, N_i, bytes)
        return np.ascontiguousarray(np.concatenate(raws, axis=1)), "mxfp4"
    widened.update(p.qtype.name for p in parts if isinstance(p, ExpertBlocks))
    return np.concatenate([np.asarray(p, dtype=dtype) for p in parts], axis=1), "dtype"


def upload_experts(lw, spec, dtype, upload, put_matrix, widened: set) -> DeviceExperts:
    """A sparse layer's LayerWeights -> DeviceExperts: ``upload`` copies a host array to the
    device as it is, ``put_matrix`` uploads a dense (out, in) matrix as the backend keeps
    them; ``widened`` collects the block formats widened to ``dtype``."""
    gate_up, fmt = _stacked([lw.e_gate, lw.e_up], dtype, widened)  # (E, 2F, D)
    down, fmt_down = _stacked([lw.e_down], dtype, widened)  # (E, D, F)
    if fmt != fmt_down:  # one format per layer: widen both
        gate_up, fmt = _stacked([np.asarray(lw.e_gate), np.asarray(lw.e_up)], dtype, widened)
        down, _ = _stacked([np.asarray(lw.e_down)], dtype, widened)
    rows = [np.asarray(lw.router, dtype=F32)]  # (E, D)
    shared = None
    if lw.s_logit is not None:
        rows.append(np.asarray(lw.s_logit, dtype=F32).reshape(1, -1))  # the gate: row E
        shared = (put_matrix(lw.s_gate, lw.s_up), put_matrix(lw.s_down))
    biases = clamp = None
    if spec.biases:
        f32 = [np.asarray(a, dtype=F32) for a in
               (lw.router_bias, lw.e_gate_bias, lw.e_up_bias, lw.e_down_bias)]  # fmt: skip
        biases = (f32[0], np.concatenate(f32[1:3], axis=1), f32[3])  # (E,), (E, 2F), (E, D)
        biases = tuple(upload(np.ascontiguousarray(b)) for b in biases)
    if spec.swiglu_limit:
        clamp = (spec.swiglu_alpha, spec.swiglu_limit)
    return DeviceExperts(
        router=upload(np.ascontiguousarray(np.concatenate(rows))),
        gate_up=upload(gate_up),
        down=upload(down),
        fmt=fmt,
        top_k=spec.top_k,
        renormalize=spec.renormalize,
        totals=upload(np.zeros(spec.num_experts, np.uint64)),
        shared=shared,
        biases=biases,
        clamp=clamp,
    )


def experts_forward(k, gemm, empty, ex: DeviceExperts, h, out, act: str, slots) -> None:
    """h (T, D) normed -> out (T, D): each token's top k experts, weighted and summed (plus the
    shared expert). ``k``: the device's Kernels; ``gemm``: the backend's products (the shared
    expert's); ``empty(shape, dtype)``: the device's allocator; ``slots`` (T,): the step's KV
    slots (a row with none, a graph's padding, is not counted in ``totals``)."""
    T, D = h.shape
    K, E, F = ex.top_k, ex.num_experts, ex.intermediate_size
    P, dt = T * K, h.dtype
    ids, weights = empty((T, K), np.int32), empty((T, K), np.float32)
    gate = empty((T,), np.float32) if ex.shared is not None else None
    b_router, b_gate_up, b_down = ex.biases or (None, None, None)
    k.moe_route(ids, weights, h, ex.router, K, ex.renormalize, b_router, gate)
    sorted_pairs, inverse = empty((P,), np.int32), empty((P,), np.int32)
    offsets = empty((E + 1,), np.int32)
    k.moe_align(sorted_pairs, inverse, offsets, ex.totals, ids, slots)
    gate_up = empty((P, 2 * F), dt)  # (P, 2F) in sorted order
    k.moe_matmul(gate_up, h, ex.gate_up, sorted_pairs, offsets, K, b_gate_up, ex.fmt)
    act_out = empty((P, F), dt)
    if ex.clamp:
        k.clamped_swiglu(act_out, gate_up, *ex.clamp)
    else:
        k.act_and_mul(act_out, gate_up, act)
    y = empty((P, D), np.float32)  # (P, D) float32, sorted order
    k.moe_matmul(y, act_out, ex.down, sorted_pairs, offsets, 0, b_down, ex.fmt)
    shared = None
    if ex.shared is not None:
        s_gate_up, s_down = ex.shared
        Fs = s_gate_up.shape[0] // 2
        s_mid, s_act, shared = empty((T, 2 * Fs), dt), empty((T, Fs), dt), empty((T, D), dt)
        gemm(h, s_gate_up, s_mid)
        k.act_and_mul(s_act, s_mid, act)
        gemm(s_act, s_down, shared)
    k.moe_combine(out, y, weights, inverse, gate, shared)


def step_bytes(spec, T: int, D: int, itemsize: int) -> int:
    """The device bytes a layer of experts allocates for a step of T tokens (every layer's
    are freed as the next reuses the pool: one layer's)."""
    P, F, Fs = T * spec.top_k, spec.intermediate_size, spec.shared_intermediate_size
    ints = 4 * (3 * P + spec.num_experts + 1) + 4 * P + 4 * T
    floats = P * 3 * F * itemsize + P * D * 4 + T * (3 * Fs + D) * itemsize
    return ints + floats + 512 * 10  # CuPy rounds each allocation
