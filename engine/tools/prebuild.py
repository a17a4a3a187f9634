"""``python -m engine.tools.prebuild run|test``: the kernels' CPU builds ahead of their first
use, cached by hash (a build already there takes no time), one line per step with its time.

  run   what ``python -m engine.generate`` runs with no flags (``make run``): the cpu backend's
        native kernels (``engine.backends.cpu_native``) for this CPU.
  test  what the tests load (``make test``'s setup): every CUDA kernel's CPU build, plain and
        under ASan (``build.build_everything``), and the native kernels for this CPU and, on
        x86-64, for x86-64-v3 and the baseline (the targets the kernel tests also run).
"""

import argparse
import platform
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from engine.backends.cpu_native import compiler_available, isa, library_path, target_name
from engine.kernels.build import build_dir, build_everything, define_sets, kernel_names


def step(what: str, build: Callable[[], None]) -> None:
    """``building <what> ... <seconds> s`` on one line: its start before, its time after."""
    print(f"building {what} ...", end=" ", flush=True)
    t0 = time.perf_counter()
    build()
    print(f"{time.perf_counter() - t0:.0f} s", flush=True)


def native(targets: list[str]) -> None:
    """One step: the cpu backend's kernels for each target this CPU can run, two at a time."""
    if not compiler_available():
        print("not built: the cpu backend's kernels need g++; auto takes the numpy backend")
        return
    runnable = []
    for target in targets:
        try:
            isa(target)
            runnable.append(target)
        except ValueError as e:  # a target this CPU cannot run: nothing to build
            print(f"not built: {e}")
    names = ", ".join(target_name(t) for t in runnable)
    with ThreadPoolExecutor(2) as pool:
        step(f"the cpu kernels for {names}", lambda: list(pool.map(library_path, runnable)))


def test_builds() -> None:
    n = sum(len(define_sets(name)) for name in kernel_names())
    step(
        f"the CUDA kernels' CPU emulation ({n} libraries, each plain and under ASan)",
        build_everything,
    )
    native(["native"] + (["x86-64-v3", "generic"] if platform.machine() == "x86_64" else []))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("run", "test"), help="the builds make run or make test needs")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.what == "run":
        native(["native"])
    else:
        test_builds()
    print(f"the kernels' builds are in {build_dir()} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
