"""Slow, obviously-correct twins of the engine's operations, held by the tests as oracles:
``numpy_ops`` (plain NumPy over the paged cache) and ``cuda_cpu_ops`` (the same functions run by
the CUDA kernels on the CPU emulator, and the sampling kernel's NumPy twin)."""
