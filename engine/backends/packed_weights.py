"""A model's weights as the NumPy-based backends multiply them: every matrix pre-transposed to
(in, out) and contiguous, Q/K/V fused into one matrix and gate/up into another (``PackedLayer``),
the embedding table and LM head beside them; a store function per matrix decides what is kept
(float32, a quantized format, a GGUF's blocks as the file has them)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from engine.backends.base import numpy_dtype
from engine.backends.moe import PackedExperts, pack_experts
from engine.backends.quant import QuantWeight
from model_loader.gguf_blocks import BlockMatrix, stack_rows
from model_loader.hf_weights import drop_pages
from model_loader.weights import ModelWeights, release_layer

F32 = np.dtype(np.float32)
HALVES = (np.dtype(np.float16), numpy_dtype("bfloat16"))
MATRICES = ("w_qkv", "w_o", "w_gate_up", "w_down")  # a PackedLayer's (K, N) matrices


@dataclass
class PackedLayer:
    """A layer's weights. The four (K, N) matrices are float32, or on the cpu backend bf16 or
    int8 (``quant.QuantWeight``), multiplied through ``ops.matmul`` either way. A layer of
    experts has ``experts`` (engine/backends/moe.py) in place of w_gate_up and w_down."""

    attn_norm: np.ndarray  # (D,) the norm's scale, offset + w (Gemma's 1 + w)
    w_qkv: np.ndarray | QuantWeight  # (D, H*hd + 2*Hkv*hd): q | k | v columns
    w_o: np.ndarray | QuantWeight  # (H*hd, D)
    mlp_norm: np.ndarray  # (D,)
    w_gate_up: np.ndarray | QuantWeight | None  # (D, 2F): gate | up columns
    w_down: np.ndarray | QuantWeight | None  # (F, D)
    b_qkv: np.ndarray | None = None  # (H*hd + 2*Hkv*hd,) q | k | v biases (Qwen2)
    b_o: np.ndarray | None = None  # (D,) the o projection's bias (gpt-oss)
    sinks: np.ndarray | None = None  # (H,) float32 each head's sink logit (gpt-oss)
    q_norm: np.ndarray | None = None  # (hd,) per-head norms of q and k (Qwen3)
    k_norm: np.ndarray | None = None  # (hd,)
    post_attn_norm: np.ndarray | None = None  # (D,) norms of the attention's and the MLP's
    post_mlp_norm: np.ndarray | None = None  # (D,) outputs (Gemma 2 and 3), offset + w
    experts: PackedExperts | None = None  # a layer of experts' router and matrices

    def arrays(self):
        """Every kept array once (a layer of experts': its router's and experts')."""
        for a in vars(self).values():
            if isinstance(a, PackedExperts):
                yield from a.arrays()
            elif a is not None:
                yield a


def _t(*mats: np.ndarray) -> np.ndarray:
    """Stack (out, in) matrices along out and transpose: (in, sum(out)), a view in their dtype
    (of the file's map for one matrix; a GGUF's blocks: model_loader.gguf_blocks, still in
    blocks): the store widens it as it converts, or keeps the blocks."""
    return stack_rows(mats).T


def _table(a: np.ndarray) -> np.ndarray:
    """The (V, D) embedding table as kept: a 16-bit float one as it is (its rows widen to float32
    exactly when gathered; half a float32 copy's bytes), a GGUF's Q8_0 / Q4 blocks as they are
    (a BlockMatrix: its gathered rows dequantized), any other float32. Read by row only."""
    if isinstance(a, BlockMatrix):
        return a
    dtype = a.dtype if a.dtype in HALVES else F32
    if a.dtype == dtype and a.flags.writeable and a.flags.c_contiguous:
        return a  # the loader's own array (a GGUF's dequantized table)
    return np.array(a, dtype=dtype)  # a copy of a mapped file's: its pages go


def _head(lm_head):
    """The (V, D) LM head's (D, V) transpose, a view: of an array, or of a GGUF's blocks."""
    return lm_head.T if isinstance(lm_head, BlockMatrix) else np.asarray(lm_head).T


def _f32(a: np.ndarray | None, offset: float = 0.0) -> np.ndarray | None:
    return None if a is None else a.astype(F32) + F32.type(offset)


def pack_weights(
    w: ModelWeights,
    round_to: np.dtype,
    norm_offset: float = 0.0,
    store=None,
    head_store=None,
    moe=None,
) -> tuple[list[PackedLayer], dict]:
    """Fused, transposed float32 weights (values first rounded through ``round_to``); norm
    scales as ``norm_offset + w``, added in float32 as Hugging Face's Gemma does. ``store``
    (and ``head_store`` for the LM head), given, turn each packed (K, N) matrix into the form
    it is kept in right after it is packed: a matrix reaches its store as a (K, N) view in the
    checkpoint's dtype (the fused ones as one copy of it), and the store widens it slice by
    slice or as a whole, so one layer's matrices at a time exist beside the kept ones.
    A layer of experts (``moe``: the config's MoeSpec) packs them through the same store."""

    def r(a: np.ndarray | None) -> np.ndarray | None:  # rounded through round_to
        return a if a is None or round_to == F32 else a.astype(round_to, copy=False)

    keep = store or (lambda m: np.ascontiguousarray(m, dtype=F32))
    layers = []
    for i, lw in enumerate(w.layers):
        bias = None if lw.bq is None else _f32(np.concatenate([r(lw.bq), r(lw.bk), r(lw.bv)]))
        sparse = lw.router is not None
        layers.append(
            PackedLayer(
                attn_norm=_f32(r(lw.attn_norm), norm_offset),
                w_qkv=keep(_t(r(lw.wq), r(lw.wk), r(lw.wv))),
                w_o=keep(_t(r(lw.wo))),
                mlp_norm=_f32(r(lw.mlp_norm), norm_offset),
                w_gate_up=None if sparse else keep(_t(r(lw.w_gate), r(lw.w_up))),
                w_down=None if sparse else keep(_t(r(lw.w_down))),
                b_qkv=bias,
                b_o=_f32(r(lw.bo)),
                sinks=_f32(r(lw.sinks)),
                q_norm=_f32(r(lw.q_norm), norm_offset),
                k_norm=_f32(r(lw.k_norm), norm_offset),
                post_attn_norm=_f32(r(lw.post_attn_norm), norm_offset),
                post_mlp_norm=_f32(r(lw.post_mlp_norm), norm_offset),
                experts=pack_experts(lw, moe, r, keep) if sparse else None,
            )
        )
        # the file's pages: packed now (a GGUF's kept blocks: the pages under their bytes)
        drop_pages(*(getattr(a, "raw", a) for a in (getattr(lw, f.name) for f in fields(lw))))
        release_layer(w.layers, i)  # a GGUF's dequantized layer: made again if asked
    embed = _table(r(w.embed))  # (V, D)
    drop_pages(w.embed)
    head = embed.T if w.lm_head is w.embed else _head(r(w.lm_head))  # (D, V) views
    # head_store takes the view (in any float dtype, or a GGUF's blocks) and widens it as it
    # converts, or keeps the blocks where they are its format
    lm_head = head_store(head) if head_store else np.ascontiguousarray(head, dtype=F32)
    drop_pages(getattr(w.lm_head, "raw", w.lm_head))
    return layers, dict(embed=embed, final_norm=_f32(r(w.final_norm), norm_offset), lm_head=lm_head)
