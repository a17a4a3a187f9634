"""Every kernel file compiles with NVRTC (the production compiler) for sm_80 and sm_90 without
register spills or local memory, and with nvcc as a second opinion. No GPU needed."""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import emulation as E
from engine import kernels as K

ARCHS = ["sm_80", "sm_90"]
# ptxas -v: "Function properties for NAME" then "N bytes stack frame, N bytes spill stores, ..."
_PROPS = re.compile(
    r"Function properties for (\w+)\s*\n[^\n]*?(\d+) bytes stack frame, "
    r"(\d+) bytes spill stores, (\d+) bytes spill loads"
)
_LMEM = re.compile(r"(\d+) bytes lmem")


def ptxas_report(log: str) -> dict[str, tuple[int, int, int]]:
    """kernel name -> (stack frame, spill stores, spill loads) bytes from a ptxas -v log."""
    return {m[1]: (int(m[2]), int(m[3]), int(m[4])) for m in _PROPS.finditer(log)}


def assert_no_local_memory(name: str, log: str, entries: list[str]) -> None:
    report = ptxas_report(log)
    assert set(entries) <= set(report), f"{name}: ptxas reported {sorted(report)}"
    bad = {k: v for k, v in report.items() if any(v)}
    assert not bad, f"{name}: stack frame / spills (bytes) {bad}\n{log}"
    lmem = [int(n) for n in _LMEM.findall(log)]
    assert not any(lmem), f"{name}: local memory {lmem}\n{log}"


# Every build: each file once, a file with compile-time constants once per define set.
BUILDS = [(name, defs) for name in K.kernel_names() for defs in K.define_sets(name)]
BUILD_IDS = [f"{n}-" + "-".join(f"{k}{v}" for k, v in d) if d else n for n, d in BUILDS]


NVRTC_TEST = "test_nvrtc_compiles_without_spills"


@pytest.fixture(scope="module")
def nvrtc_results(request):
    """The NVRTC compile of every selected (name, defines, arch) case, submitted in test order
    to two threads at once (NVRTC releases the GIL): each case waits for its own future and
    gets its result or its error."""
    cases = [
        item.callspec.params
        for item in request.session.items
        if getattr(item, "originalname", None) == NVRTC_TEST and item.module.__name__ == __name__
    ]
    with ThreadPoolExecutor(2) as pool:
        futures = {
            (c["name"], c["defines"], c["arch"]): pool.submit(
                K.compile_nvrtc, c["name"], c["arch"], c["defines"]
            )
            for c in cases
        }
        yield futures
        for future in futures.values():  # a run stopped early (-x) leaves the rest
            future.cancel()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("name", "defines"), BUILDS, ids=BUILD_IDS)
def test_nvrtc_compiles_without_spills(name, defines, arch, nvrtc_results):
    result = nvrtc_results[(name, defines, arch)].result()
    assert result.cubin[:4] == b"\x7fELF"  # a cubin, not PTX
    entries = K.entry_points(K.read_source(name))
    assert entries, f'{name}.cu defines no extern "C" __global__ kernel'
    assert_no_local_memory(name, result.log, entries)


def test_decode_builds_need_their_defines():
    """The decode file is built per (head dim, block size); without them, one clear error."""
    assert len(K.define_sets("paged_attention_decode")) > 1
    with pytest.raises(ValueError, match=r"needs defines \['BLOCK_SIZE', 'HEAD_DIM'\], got \[\]"):
        K.compile_cpu("paged_attention_decode")
    with pytest.raises(ValueError, match=r"define HEAD_DIM must be a positive int, got 0"):
        K.compile_nvrtc("paged_attention_decode", "sm_90", {"HEAD_DIM": 0, "BLOCK_SIZE": 16})
    with pytest.raises(ValueError, match=r"rms_norm.cu needs defines \[\], got \['HEAD_DIM'\]"):
        E.cpu_module("rms_norm", {"HEAD_DIM": 64})
    a = K.compile_cpu("paged_attention_decode", defines={"HEAD_DIM": 16, "BLOCK_SIZE": 16})
    b = K.compile_cpu("paged_attention_decode", defines={"BLOCK_SIZE": 16, "HEAD_DIM": 64})
    assert a != b and "HEAD_DIM16" in a.name and "HEAD_DIM64" in b.name


def test_every_kernel_is_a_template_with_grid_comment_and_three_dtypes():
    for name in K.kernel_names():
        source = K.read_source(name)
        entries = K.entry_points(source)
        for stem in {re.sub(r"_(f32|f16|bf16)$", "", e) for e in entries}:
            assert {f"{stem}_{s}" for s in K.ENTRY_SUFFIXES} <= set(entries), stem
            lines = source[: source.index(f" void {stem}(")].splitlines()
            assert lines[-2] == "template <typename T>", f"{name}.cu: {stem} is no template"
            assert lines[-3].startswith("// Grid:"), f"{name}.cu: no // Grid: line over {stem}"


def test_ptxas_parser_sees_spills():
    """The check above must be able to fail: a report with a stack frame is caught."""
    log = (
        "ptxas info    : Function properties for k\n"
        "    16 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n"
    )
    assert ptxas_report(log) == {"k": (16, 8, 8)}
    with pytest.raises(AssertionError, match="stack frame / spills"):
        assert_no_local_memory("k", log, ["k"])


def test_compile_errors_point_at_the_cu_line(tmp_path, monkeypatch):
    broken = tmp_path / "broken.cu"
    broken.write_text('#include "common.cuh"\n\nextern "C" __global__ void k() { undefined_x; }\n')
    monkeypatch.setattr(K.build, "SRC_DIR", tmp_path)
    monkeypatch.setattr(
        K.build,
        "nvrtc_options",
        lambda arch: (
            [f"-arch={arch}", f"-I{K.REPO / 'cuda_src'}"]
            + [f"-I{d}" for d in K.cuda_include_dirs()]
        ),
    )
    with pytest.raises(K.KernelBuildError, match=rf"{re.escape(str(broken))}\(3\): error"):
        K.compile_nvrtc("broken", "sm_90")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")
def test_nvcc_second_opinion(tmp_path):
    """nvcc -arch=sm_90 -c on every file, one define set each (two nvcc processes, one per
    core): no errors, warnings, spills or stack."""
    cmd = ["nvcc", "-arch=sm_90", "-std=c++17", f"-I{K.SRC_DIR}", "-Xptxas", "-v", "-c"]
    jobs = []  # (command, folder): one folder per define set, so the .o names do not clash
    # one define set of each file: nvcc's front end reads the same source for every set, and
    # NVRTC checks every set's registers and spills above
    for i, (name, defines) in enumerate(dict(reversed(BUILDS)).items()):
        folder = tmp_path / str(i)
        folder.mkdir()
        jobs.append((cmd + K.define_options(defines) + [str(K.SRC_DIR / f"{name}.cu")], folder))

    def run(job) -> subprocess.CompletedProcess:
        command, folder = job
        return subprocess.run(command, cwd=folder, stderr=subprocess.PIPE, text=True)

    with ThreadPoolExecutor(2) as pool:  # the next file starts as soon as one ends
        results = list(pool.map(run, jobs))
    stderr = "".join(r.stderr for r in results)
    assert all(r.returncode == 0 for r in results), stderr
    assert "warning" not in stderr.lower(), stderr
    entries = [e for n in dict(BUILDS) for e in K.entry_points(K.read_source(n))]
    assert_no_local_memory("nvcc", stderr, entries)
