"""The GPU backend's weights on the device: each layer's as a ``DeviceLayer`` (the matrices as
the backend multiplies them: the activations' dtype, or a GGUF's blocks where the kernels read
their format; a layer of experts as ``cupy_moe.DeviceExperts``), the embedding, the final norm
and the LM head. ``DeviceWeights`` is a part of ``CupyBackend`` (its device, config and dtype).
"""

from __future__ import annotations

import logging

import numpy as np

from engine.backends.cupy_blocks import keep_blocks
from engine.backends.cupy_moe import upload_experts
from engine.backends.cupy_step import DeviceLayer
from model_loader.weights import ModelWeights

log = logging.getLogger("engine.backend")


class DeviceWeights:
    def _put(self, *arrays: np.ndarray):
        """Upload (stacking several along rows) in the backend's dtype."""
        a = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)
        return self.device.upload(np.ascontiguousarray(a, dtype=self.dtype))

    def _put_opt(self, *arrays):
        return None if arrays[0] is None else self._put(*arrays)

    def _put_f32(self, a):
        return None if a is None else self.device.upload(np.ascontiguousarray(a, np.float32))

    def _put_matrix(self, *mats):
        """(out, in) matrices stacked along rows: a GGUF's kept in their blocks where the
        kernels read every part's format (engine/backends/cupy_blocks.py), else ``_put``."""
        kept = keep_blocks(mats, self.device.upload)
        return kept if kept is not None else self._put(*mats)

    def _upload_weights(self, w: ModelWeights) -> None:
        off = self.cfg.norm_offset  # Gemma 3's q and k norms are (1 + w) too
        widened: set[str] = set()  # expert block formats moe_matmul does not read
        self.layers = [
            DeviceLayer(
                attn_norm=self._put(lw.attn_norm),
                w_qkv=self._put_matrix(lw.wq, lw.wk, lw.wv),
                w_o=self._put_matrix(lw.wo),
                mlp_norm=self._put(lw.mlp_norm),
                w_gate_up=None if lw.router is not None else self._put_matrix(lw.w_gate, lw.w_up),
                w_down=None if lw.router is not None else self._put_matrix(lw.w_down),
                b_qkv=self._put_opt(lw.bq, lw.bk, lw.bv),
                q_norm=self._put_opt(_offset(lw.q_norm, off)),  # the kernel scales by w
                k_norm=self._put_opt(_offset(lw.k_norm, off)),
                post_attn_norm=self._put_opt(lw.post_attn_norm),
                post_mlp_norm=self._put_opt(lw.post_mlp_norm),
                b_o=self._put_f32(lw.bo),
                sinks=self._put_f32(lw.sinks),
                experts=self._experts(lw, widened),
            )
            for lw in w.layers
        ]
        if widened:
            log.info("experts in %s widened to %s: the cuda experts read only it and MXFP4",
                     ", ".join(sorted(widened)), self.kv_dtype)  # fmt: skip
        self.embed = self._put(w.embed)  # (V, D)
        self.final_norm = self._put(w.final_norm)  # (D,)
        self.lm_head = self.embed if w.lm_head is w.embed else self._put_matrix(w.lm_head)
        self._log_formats()

    def _experts(self, lw, widened: set):
        """A sparse layer's experts on the device (engine/backends/cupy_moe.py); None: dense."""
        if lw.router is None:
            return None
        args = (self.cfg.moe, self.dtype, self.device.upload, self._put_matrix, widened)
        return upload_experts(lw, *args)


def _offset(a: np.ndarray | None, offset: float) -> np.ndarray | None:
    """A norm's scale as offset + w, added in float32 (Gemma's 1 + w); None stays None."""
    return a if a is None or not offset else np.asarray(a, np.float32) + np.float32(offset)
