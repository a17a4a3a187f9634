"""Load the CUDA kernels of ``cuda_src/`` for every backend, and launch them with checks.

One source, three compilers:
  ``compile_nvrtc(name, arch)``  NVRTC through ``cupy.cuda.nvrtc`` (no device needed): a cubin
                                 and the ptxas report; the production compiler.
  ``cpu_module(name)``           g++ with ``cuda_src/cpu/cuda_emu.h``: a shared library whose
                                 kernels run on the CPU, one fiber per CUDA thread
                                 (engine/emulation/, which loads them).
  ``cupy.RawModule``             the GPU backend, on ``read_source(name)`` with the same names.
Each takes ``defines`` too: a file built per set of compile-time constants (the decode
attention's head dim and block size) gets them as ``-D`` options, one build per set.

  build.py     sources, entry points, the NVRTC and g++ builds
  launch.py    ``Kernels``: one checked launch per operation over a module loader; block sizes
  checks.py    the launches' argument checks
  moe_launch.py   a mixture of experts' launches (``Kernels.moe_route``, ``moe_matmul``, ...)
  gguf_launch.py  the GGUF block products' launches (``Kernels.gguf_matvec``, ``gguf_dequantize``)
  cublas.py    cuBLAS through the engine's own handle (graph capture)
  gemm.py      ``out = x @ w.T`` for the GPU backend, one cuBLAS GemmEx per product
"""

from engine.kernels.build import (
    ASAN_ENV,
    BUILD_ENV,
    EMU_DIR,
    ENTRY_SUFFIXES,
    REPO,
    SRC_DIR,
    KernelBuildError,
    NvrtcResult,
    asan_enabled,
    asan_env,
    build_all_cpu,
    build_cpu_library,
    build_dir,
    compile_cpu,
    compile_cpu_source,
    compile_nvrtc,
    cuda_include_dirs,
    define_options,
    define_sets,
    entry_points,
    gxx_flags,
    include_options,
    kernel_names,
    normalize_defines,
    nvrtc_options,
    read_source,
)
from engine.kernels.checks import DTYPE_SUFFIX
from engine.kernels.launch import (
    ACTIVATIONS,
    ATTN_THREADS,
    DECODE_CHUNK,
    EMULATED_SM_COUNT,
    MAX_HEAD_DIM,
    NORM_THREADS,
    PARTITION_SIZE,
    PREFILL_TILE,
    ROTARY_TOKENS_PER_BLOCK,
    ROW_CACHE,
    SAMPLE_THREADS,
    Kernels,
    decode_split,
    row_launch,
)

__all__ = [
    "ACTIVATIONS",
    "ASAN_ENV",
    "ATTN_THREADS",
    "BUILD_ENV",
    "DECODE_CHUNK",
    "DTYPE_SUFFIX",
    "EMU_DIR",
    "ENTRY_SUFFIXES",
    "EMULATED_SM_COUNT",
    "MAX_HEAD_DIM",
    "NORM_THREADS",
    "PARTITION_SIZE",
    "PREFILL_TILE",
    "REPO",
    "ROTARY_TOKENS_PER_BLOCK",
    "ROW_CACHE",
    "SAMPLE_THREADS",
    "SRC_DIR",
    "KernelBuildError",
    "Kernels",
    "NvrtcResult",
    "asan_enabled",
    "asan_env",
    "build_all_cpu",
    "build_cpu_library",
    "build_dir",
    "compile_cpu",
    "compile_cpu_source",
    "compile_nvrtc",
    "cuda_include_dirs",
    "decode_split",
    "define_options",
    "define_sets",
    "entry_points",
    "gxx_flags",
    "include_options",
    "kernel_names",
    "normalize_defines",
    "nvrtc_options",
    "read_source",
    "row_launch",
]
