"""The GPU backend's LoRA slots: per layer and fused matrix, every slot's A and B in device
memory, written by ``set_lora``, applied after each product by the segmented LoRA kernels
(engine/kernels/launch.py ``Kernels.lora``). ``LoRASlots`` is a part of ``CupyBackend`` (its
device, config, dtype and layers).
"""

from __future__ import annotations

import numpy as np

from engine.backends.cupy_step import DeviceLayer, StepInputs, on_device


class LoRASlots:
    def _allocate_lora(self) -> None:
        """Per layer and fused matrix, every slot's A (S, M R, K) and B (S, R, N), zeros, and
        each matrix's module ends (M,) on the device: one fixed place per slot, written by
        ``set_lora`` (engine/kernels/launch.py ``Kernels.lora`` reads them)."""
        self.lora_layers, self.lora_ends, self.lora_used = [], {}, []
        if self.lora_shape is None:
            return
        S, R = self.lora_shape
        for name, (_, widths) in self.cfg.fused_shapes.items():
            self.lora_ends[name] = self.device.upload(np.cumsum(widths).astype(np.int32))
        for _ in self.layers:
            self.lora_layers.append(
                {
                    name: (
                        self.device.zeros((S, len(widths) * R, K), self.dtype),  # (S, M R, K)
                        self.device.zeros((S, R, sum(widths)), self.dtype),  # (S, R, N)
                    )
                    for name, (K, widths) in self.cfg.fused_shapes.items()
                }
            )
            self.lora_used.append({name: set() for name in self.lora_ends})

    @on_device
    def set_lora(self, slot: int, weights) -> None:
        """Slot ``slot`` holds this adapter (engine/lora/adapter.py ``LoRAWeights``, this
        rank's cut) from now on: module m's A^T in A's rows m R.., its B in B's rows 0.. of
        the module's columns; zeros past the module's rank and where the adapter has none."""
        if self.lora_shape is None:
            raise ValueError("set_lora: this backend was built without enable_lora")
        S, R = self.lora_shape
        for i, layer in enumerate(self.lora_layers):
            for name, (a_dev, b_dev) in layer.items():
                pair = weights.layers[i].get(name)
                ends = np.cumsum(self.cfg.fused_shapes[name][1]).tolist()
                a = np.zeros(a_dev.shape[1:], np.float32)  # (M R, K)
                b = np.zeros(b_dev.shape[1:], np.float32)  # (R, N)
                for r0, r1, c0, bm in pair[1] if pair is not None else ():
                    c1 = c0 + bm.shape[1]  # a fused module (q|k|v) spans several of the kernel's
                    for m, (s, e) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
                        lo, hi = max(s, c0), min(e, c1)
                        if lo < hi:
                            a[m * R : m * R + r1 - r0] = pair[0][:, r0:r1].T
                            b[: r1 - r0, lo:hi] = bm[:, lo - c0 : hi - c0]
                self.device.copy_to(a_dev[slot], a.astype(self.dtype))
                self.device.copy_to(b_dev[slot], b.astype(self.dtype))
                self.lora_used[i][name].discard(slot)
                if pair is not None and pair[1]:
                    self.lora_used[i][name].add(slot)
        self.device.synchronize()

    @property
    def lora_bytes(self) -> int:
        """The device slots (every slot, used or not)."""
        return sum(int(a.nbytes) for layer in self.lora_layers for p in layer.values() for a in p)

    def _gemm(self, x, lw: DeviceLayer, layer: int, name: str, out, inp: StepInputs) -> None:
        """out = x @ the layer's matrix ``name``, plus each LoRA row's update (the segmented
        products, engine/kernels/launch.py ``Kernels.lora``) when a step's adapter changes it."""
        self.gemm(x, getattr(lw, name), out)
        if inp.lora is not None and inp.lora[2] & self.lora_used[layer][name]:
            a, b = self.lora_layers[layer][name]
            self.k.lora(out, x, a, b, inp.lora[0], inp.lora[1], self.lora_ends[name])
