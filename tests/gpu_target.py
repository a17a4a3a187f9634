"""What the ``gpu`` tests run on: the GPU through CuPy, or, with PAGEDLLM_EMULATE_GPU=1, the
emulated device, so ``scripts/gpu_check.sh --emulate`` runs the very tests a GPU would (and CI
finds a broken GPU test before a GPU does)."""

from __future__ import annotations

import os

EMULATE = os.environ.get("PAGEDLLM_EMULATE_GPU") == "1"
BACKEND = "cuda-cpu" if EMULATE else "cuda"


def make_device():
    from engine.devices.device import CupyDevice
    from engine.emulation.device import EmulatedDevice

    return EmulatedDevice() if EMULATE else CupyDevice()
