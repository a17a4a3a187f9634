"""The CUDA emulation: the GPU backend's own code run on the host, with CUDA's rules checked.

kernels.py     the kernels' CPU builds (g++ with ``cuda_src/cpu/cuda_emu.h``, one fiber per CUDA
               thread) loaded and launched like CuPy's; thread order; the counting builds'
               global memory traffic; ``cpu_kernels()``: the checked launches over them
runtime.py     streams, events, cuBLAS on raw memory, and CUDA's, cuBLAS's and CuPy's graph
               capture rules, enforced
device.py      ``EmulatedDevice``: the ``cuda-cpu`` backend's device (NumPy memory)
nccl.py        NCCL between emulated ranks (processes), its rules enforced
kernel_ops.py  the engine's operations run through the emulated kernels (the oracles' twin of
               ``reference.kernel_ops``)
"""

from engine.emulation.kernels import (
    ORDERS,
    CpuKernel,
    CpuModule,
    KernelLaunchError,
    Traffic,
    counting_kernels,
    cpu_kernels,
    cpu_module,
    cpu_module_from_source,
    memory_traffic,
    merged_ranges,
    set_thread_order,
    thread_order,
)

__all__ = [
    "ORDERS",
    "CpuKernel",
    "CpuModule",
    "KernelLaunchError",
    "Traffic",
    "counting_kernels",
    "cpu_kernels",
    "cpu_module",
    "cpu_module_from_source",
    "memory_traffic",
    "merged_ranges",
    "set_thread_order",
    "thread_order",
]
