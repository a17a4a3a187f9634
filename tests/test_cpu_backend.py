"""The cpu backend's choice and threads: ``auto`` picks it without a GPU (numpy without g++),
its thread count comes from the cores this process may use or PAGEDLLM_CPU_THREADS (a bad one
is one line), an oversubscribed machine is logged once, and it refuses tensor parallel by name.
Its tokens are checked against the golden data in test_engine, test_golden and test_families;
its kernels in test_cpu_kernels."""

from __future__ import annotations

import logging

import pytest

from engine.backends import cpu_native, resolve_backend_name
from tests.utils import make_engine


@pytest.fixture
def fresh_threads(monkeypatch):
    monkeypatch.setattr(cpu_native, "_threads", [])
    return monkeypatch


def test_auto_is_cpu_without_a_gpu_and_numpy_without_a_compiler(monkeypatch):
    from engine.devices import device as devices

    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    assert resolve_backend_name("auto") == "cpu"
    monkeypatch.setattr(cpu_native.shutil, "which", lambda name: None)
    assert resolve_backend_name("auto") == "numpy"
    with pytest.raises(cpu_native.NativeBuildError, match="the cpu backend needs g\\+\\+"):
        cpu_native.library_path()


def test_threads_follow_the_affinity_or_the_environment(fresh_threads):
    fresh_threads.delenv(cpu_native.THREADS_ENV, raising=False)  # `make test` sets it
    fresh_threads.setattr(cpu_native.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    fresh_threads.setattr(cpu_native.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert cpu_native.threads() == 3
    fresh_threads.setattr(cpu_native, "_threads", [])
    fresh_threads.setenv(cpu_native.THREADS_ENV, "1")
    assert cpu_native.threads() == 1
    for bad in ("0", "two"):
        fresh_threads.setattr(cpu_native, "_threads", [])
        fresh_threads.setenv(cpu_native.THREADS_ENV, bad)
        with pytest.raises(
            ValueError, match=f"PAGEDLLM_CPU_THREADS must be a positive int, got '{bad}'"
        ):
            cpu_native.threads()


def test_an_oversubscribed_machine_is_logged_once(fresh_threads, caplog):
    fresh_threads.setattr(cpu_native.os, "getloadavg", lambda: (40.0, 40.0, 40.0))
    with caplog.at_level(logging.WARNING, logger="engine.backend"):
        cpu_native.threads()
        cpu_native.threads()
    warned = [r for r in caplog.records if "oversubscribed" in r.getMessage()]
    assert len(warned) == 1 and "load average 40.0" in warned[0].getMessage()


def test_tensor_parallel_on_cpu_is_refused_by_name(tiny):
    with pytest.raises(ValueError, match="the cpu backend runs one rank"):
        make_engine(tiny, backend="cpu", tensor_parallel_size=2)


def test_a_cpu_backend_that_cannot_be_built_is_numpy_under_auto_and_an_error_by_name(
    tiny, monkeypatch, caplog
):
    from engine.devices import device as devices

    def no_build():
        raise cpu_native.NativeBuildError("g++ failed on cpu_src/:\nsome log")

    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    monkeypatch.setattr(cpu_native, "_lib", [])
    monkeypatch.setattr(cpu_native, "library_path", no_build)
    with caplog.at_level(logging.WARNING, logger="engine.backend"):
        assert make_engine(tiny).backend.name == "numpy"
    assert "backend auto -> numpy: g++ failed on cpu_src/:" in caplog.text
    with pytest.raises(ValueError, match="^g\\+\\+ failed on cpu_src/:$"):
        make_engine(tiny, backend="cpu")


def test_a_head_dim_the_kernels_cannot_take_is_numpy_under_auto_and_an_error_by_name(
    tmp_path, monkeypatch, caplog
):
    from engine.devices import device as devices
    from model_loader.load import load_model
    from model_loader.synthetic import make_tiny_model

    loaded = load_model(str(make_tiny_model(tmp_path / "hd24", head_dim=24)))
    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    with caplog.at_level(logging.WARNING, logger="engine.backend"):
        assert make_engine(loaded).backend.name == "numpy"
    assert "head_dim a multiple of 16 up to 256; this model's is 24" in caplog.text
    with pytest.raises(ValueError, match="^the cpu backend's attention needs head_dim"):
        make_engine(loaded, backend="cpu")
