"""``python -m engine.kernels.prebuild`` (``make setup`` runs it): every kernel's CPU build, plain
and under ASan, ahead of the tests (``build.build_everything``)."""

import time

from .build import build_dir, build_everything

t0 = time.perf_counter()
build_everything()
print(f"the kernels' CPU builds are in {build_dir()} ({time.perf_counter() - t0:.0f} s)")
