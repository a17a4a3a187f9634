"""The native CPU backend: the NumPy backend's forward, its weights and matrix products (NumPy's
BLAS), with everything between the products run by the C++ kernels of ``cpu_src/``
(``cpu_ops``): paged decode and prefill attention, rotary fused with the cache write, the
residual add fused with RMSNorm, SiLU-and-mul, multi-threaded over (sequence, KV head).
The same KV layout and interface; ``auto`` picks it where there is no GPU and g++ is there.

Its matrices (every layer's four and the LM head) take fewer bytes where the values allow:
with ``--dtype bfloat16`` they are kept as bf16 (the same values the numpy backend holds in
float32, half the bytes), with ``--quantization int8`` as int8 and a scale per column (a
quarter); ``cpu_ops.matmul`` multiplies them by a float32 x, accumulating in float32.
"""

from __future__ import annotations

from reference.config import ModelConfig
from reference.weights import ModelWeights

from ..forward_batch import ForwardBatch
from . import cpu_ops
from .cpu_native import library, threads
from .numpy_backend import NumpyBackend, PackedLayer
from .quant import to_bf16, to_int8


class CpuBackend(NumpyBackend):
    name = "cpu"

    def __init__(self, model_config: ModelConfig, weights: ModelWeights, engine_config):
        library()  # build (once per source change) and load the kernels now, not mid-step
        threads()
        super().__init__(model_config, weights, engine_config, ops=cpu_ops)

    def _matrix_store(self, quantization: str | None):
        # int8 -> int8 + scales; bf16 values (--dtype bfloat16) -> bf16 bits; else float32
        if quantization == "int8":
            return to_int8
        return to_bf16 if self.kv_dtype == "bfloat16" else None

    def _rotary_cache(self, qkv, lw: PackedLayer, k_cache, v_cache, b: ForwardBatch):
        # qkv (T, H*hd + 2*Hkv*hd) -> rotated q (T, H, hd); k, v rotated and cached, one pass
        c = self.cfg
        return self.ops.rotary_cache(
            qkv, b.positions, c.rope, k_cache, v_cache, b.slot_mapping, c.num_attention_heads,
            lw.b_qkv, lw.q_norm, lw.k_norm, c.rms_norm_eps,
        )  # fmt: skip
