"""A layer of experts as cpu_src/decode_layers.cpp runs it inside the one-call decode: the
``Experts`` structure (the router, each expert's matrices as ``moe_experts`` takes them, the
rows-per-expert counts) built once per layer from its ``PackedExperts``.

``native_experts`` answers None for a layer the one-call decode does not route (a shared
expert, gpt-oss's biases, an activation ``moe_experts`` lacks, experts of mixed kinds): such a
model's steps take the layer loop, where ``moe.experts_forward`` runs them."""

from __future__ import annotations

import ctypes

import numpy as np

from engine.backends import cpu_ops
from engine.backends.moe import PackedExperts

_ptr, _i32 = ctypes.c_void_p, ctypes.c_int32


class Experts(ctypes.Structure):  # cpu_src/decode_layers.cpp: Experts
    _fields_ = [
        *((name, _ptr) for name in ("router", "gate_up", "down", "chosen")),
        *((name, _i32) for name in ("E", "top_k", "F", "renormalize", "act")),
        ("alpha", ctypes.c_float),
        ("limit", ctypes.c_float),
    ]


def native_experts(layer: PackedExperts, act: str) -> Experts | None:
    """The layer's Experts (its arrays kept alive by ``layer``), or None where the one-call
    decode cannot run it."""
    if layer.shared is not None or layer.biases is not None or layer.clamp:
        return None
    code = cpu_ops.NATIVE_ACTS.get(act)
    mats = cpu_ops._expert_matrices(layer)
    router, chosen = layer.router, layer.chosen
    ok = router.dtype == np.float32 and router.flags.c_contiguous and chosen.flags.c_contiguous
    if code is None or mats is None or not ok:
        return None
    gate_up, down = mats
    E, F = len(layer.down), layer.down[0].shape[0]
    return Experts(
        cpu_ops._p(router), ctypes.addressof(gate_up), ctypes.addressof(down),
        cpu_ops._p(chosen), E, layer.top_k, F, int(layer.renormalize), code, 0.0, 0.0,
    )  # fmt: skip
