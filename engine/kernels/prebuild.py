"""``python -m engine.kernels.prebuild`` (``make setup`` runs it): every CUDA kernel's CPU build,
plain and under ASan (``build.build_everything``), and the cpu backend's native kernels
(``engine.backends.cpu_native``), ahead of the tests and the first run."""

import time

from ..backends.cpu_native import compiler_available, library_path
from .build import build_dir, build_everything

t0 = time.perf_counter()
build_everything()
if compiler_available():
    library_path()
print(f"the kernels' CPU builds are in {build_dir()} ({time.perf_counter() - t0:.0f} s)")
