"""The kernels' builds and their progress: the native build compiles each cpu_src/ file on its
own and links them into one working library, logging what it builds and its time (a g++ error
is one NativeBuildError naming the file, and leaves nothing behind); a CUDA emulation build at
first use logs its time, a cached one nothing; ``prebuild run`` builds only the cpu kernels for
this CPU, ``prebuild test`` the rest, a line per step with its time."""

from __future__ import annotations

import ctypes
import logging
import platform
import re

import numpy as np
import pytest

from engine.backends import cpu_native
from engine.kernels import build
from engine.tools import prebuild

# two files that call each other: the library works only if both objects are linked
SOURCES = {
    "scale.cpp": 'extern "C" float scale(float x, float s) { return x * s; }\n',
    "dot_scaled.cpp": (
        'extern "C" float scale(float x, float s);\n'
        'extern "C" float dot_scaled(const float* x, const float* y, int n, float s) {\n'
        "  float acc = 0.f;\n"
        "  for (int i = 0; i < n; ++i) acc += x[i] * y[i];\n"
        "  return scale(acc, s);\n"
        "}\n"
    ),
}


@pytest.fixture
def tiny_src(tmp_path, monkeypatch):
    """cpu_native built from SOURCES in tmp_path/src into tmp_path/build."""
    src = tmp_path / "src"
    src.mkdir()
    for name, text in SOURCES.items():
        (src / name).write_text(text)
    monkeypatch.setattr(cpu_native, "SRC", src)
    monkeypatch.setenv(build.BUILD_ENV, str(tmp_path / "build"))
    return src


def test_the_native_build_links_every_file_and_logs_its_time(tiny_src, caplog):
    caplog.set_level(logging.INFO, "engine.backend")
    path = cpu_native.library_path()
    lines = [r.getMessage() for r in caplog.records]
    what = f"the native CPU kernels for {cpu_native.target_name()}"
    assert lines[0].startswith(f"building {what} (g++, 2 files, ")
    assert re.fullmatch(rf"built {re.escape(what)} in \d+\.\d s", lines[1]), lines[1]
    lib = ctypes.CDLL(str(path))
    lib.dot_scaled.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float]
    lib.dot_scaled.restype = ctypes.c_float
    rng = np.random.default_rng()
    x, y = rng.standard_normal((2, 37), dtype=np.float32)
    s = float(rng.uniform(0.5, 2.0))
    got = lib.dot_scaled(x.ctypes.data, y.ctypes.data, 37, s)
    assert got == pytest.approx(float(np.dot(x, y)) * s, rel=1e-5, abs=1e-5)
    caplog.clear()
    assert cpu_native.library_path() == path and not caplog.records  # cached: no build, no line
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no objects left behind


def test_a_file_g_plus_plus_rejects_is_one_error_naming_it(tiny_src):
    (tiny_src / "broken.cpp").write_text('extern "C" int broken() { return undeclared; }\n')
    with pytest.raises(cpu_native.NativeBuildError, match=r"g\+\+ failed on cpu_src/:\n.*broken"):
        cpu_native.library_path()
    out = build.build_dir() / "native"
    assert not list(out.iterdir())  # neither a library nor a half-built one's objects


def test_an_emulation_build_at_first_use_logs_its_time(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(build.BUILD_ENV, str(tmp_path))
    caplog.set_level(logging.INFO, "engine.kernels")
    source = 'extern "C" __global__ void fill_one(float* out) { out[threadIdx.x] = 1.f; }\n'
    path = build.compile_cpu_source(source, "fill_one")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert re.fullmatch(r"built fill_one for the CUDA emulation in \d+\.\d s", lines[0])
    caplog.clear()
    assert build.compile_cpu_source(source, "fill_one") == path and not caplog.records


@pytest.fixture
def recorded(monkeypatch):
    """prebuild with its builds recorded instead of run."""
    calls = []
    monkeypatch.setattr(prebuild, "library_path", lambda target: calls.append(target))
    monkeypatch.setattr(prebuild, "build_everything", lambda: calls.append("emulation"))
    return calls


def test_prebuild_run_builds_only_the_cpu_kernels_for_this_cpu(recorded, capsys):
    prebuild.main(["run"])
    assert recorded == ["native"]
    first = capsys.readouterr().out.splitlines()[0]
    name = re.escape(cpu_native.target_name())
    assert re.fullmatch(rf"building the cpu kernels for {name} \.\.\. \d+ s", first), first


def test_prebuild_test_builds_the_rest_a_line_per_step(recorded, capsys):
    prebuild.main(["test"])
    x86 = platform.machine() == "x86_64"
    assert recorded[0] == "emulation"
    assert sorted(recorded[1:]) == sorted(["native"] + (["x86-64-v3", "generic"] * x86))
    lines = capsys.readouterr().out.splitlines()
    n = sum(len(build.define_sets(name)) for name in build.kernel_names())
    emulation = rf"the CUDA kernels' CPU emulation \({n} libraries, each plain and under ASan\)"
    assert re.fullmatch(rf"building {emulation} \.\.\. \d+ s", lines[0]), lines[0]
    assert re.fullmatch(r"building the cpu kernels for this CPU \(.+\) \.\.\. \d+ s", lines[1])


def test_prebuild_refuses_another_word(capsys):
    with pytest.raises(SystemExit):
        prebuild.main(["everything"])
    assert "invalid choice: 'everything'" in capsys.readouterr().err
