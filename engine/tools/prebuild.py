"""``python -m engine.tools.prebuild`` (``make setup`` runs it): every CUDA kernel's CPU build,
plain and under ASan (``build.build_everything``), and the cpu backend's native kernels
(``engine.backends.cpu_native``) for this CPU and, on x86-64, for x86-64-v3 and the baseline
(the targets the kernel tests also run), ahead of the tests and the first run."""

import platform
import time
from concurrent.futures import ThreadPoolExecutor

from engine.backends.cpu_native import compiler_available, library_path
from engine.kernels.build import build_dir, build_everything


def _native(target: str) -> None:
    try:
        library_path(target)
    except ValueError as e:  # a target this CPU cannot run: nothing to build
        print(f"not built: {e}")


t0 = time.perf_counter()
build_everything()
if compiler_available():
    targets = ["native"] + (["x86-64-v3", "generic"] if platform.machine() == "x86_64" else [])
    with ThreadPoolExecutor(2) as pool:  # one g++ a core
        list(pool.map(_native, targets))
print(f"the kernels' CPU builds are in {build_dir()} ({time.perf_counter() - t0:.0f} s)")
