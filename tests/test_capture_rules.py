"""The rules a CUDA graph capture lives by, on the emulated device and, where one is at hand, on
a GPU: the same tests, so the emulation is held to what CuPy and CUDA really do.

- CuPy's cuBLAS module refuses to run while the current stream captures; the engine's own
  handle (``engine.kernels.cublas``) is captured, and the graph replays on new inputs.
- A host synchronisation spoils the capture; host<->device copies raise (CuPy's checks).
- A capture that allocates what its warm-up did not fails (the engine's rule).
- A backend whose capture fails logs why and serves eager.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from engine.backends.cupy_backend import CupyBackend
from engine.config import EngineConfig
from engine.devices.device import CaptureAllocationError
from engine.emulation.device import EmulatedDevice
from engine.kernels.cublas import Cublas, host_scalar
from engine.kernels.gemm import gemm_plan
from engine.utils import cdiv
from reference.model import forward as reference_forward


@pytest.fixture(scope="module", params=["emulated", pytest.param("gpu", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "emulated":
        return EmulatedDevice()
    return request.getfixturevalue("gpu_device")  # a GPU, or emulated (tests/gpu_target.py)


@pytest.fixture
def dev(device):
    with device.active():
        yield device


@pytest.fixture
def rng():
    return np.random.default_rng()


def cupy_module_gemm(dev, x, w, out) -> None:
    """out = x @ w.T the way the engine must not: through CuPy's cuBLAS module and handle."""
    p, cublas, handle = gemm_plan(x, w, out), dev.cupy_cublas, dev.cupy_cublas_handle()
    cublas.setPointerMode(handle, 0)
    args = p.ex_args(dev.ptr(w), dev.ptr(x), dev.ptr(out), host_scalar(1.0), host_scalar(0.0))
    cublas.gemmEx(handle, *args)


def operands(dev, rng, M=9, K=64, N=48):
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    return x, w, dev.upload(x), dev.upload(w)


def test_cupy_cublas_refuses_while_capturing(dev, rng):
    x, w, x_d, w_d = operands(dev, rng)
    out = dev.empty((9, 48), np.float32)
    cupy_module_gemm(dev, x_d, w_d, out)  # eager: CuPy's module works
    np.testing.assert_allclose(dev.download(out), x @ w.T, rtol=1e-4, atol=1e-4)
    with pytest.raises(NotImplementedError, match="cuBLAS API during stream capture"):
        dev.capture(lambda: cupy_module_gemm(dev, x_d, w_d, out))
    assert not dev.stream.is_capturing()


def test_own_cublas_handle_is_captured_and_replays_on_new_inputs(dev, rng):
    x, w, x_d, w_d = operands(dev, rng)
    norm = rng.standard_normal(48).astype(np.float32) + 1
    norm_d = dev.upload(norm)

    def step():  # temporaries allocated inside, as the decode step does
        y, h = dev.empty((9, 48), np.float32), dev.empty((9, 48), np.float32)
        dev.gemm(x_d, w_d, y)
        dev.kernels.rms_norm(h, y, norm_d, 1e-5)
        return h

    replay = dev.capture(step)
    host = dev.pinned_empty((9, 64), np.float32)  # staging, as the engine's graph inputs
    for _ in range(2):  # new inputs written in place before each replay
        host[...] = x_new = rng.standard_normal((9, 64)).astype(np.float32)
        dev.copy_to(x_d, host)
        got = dev.download(replay())
        y = x_new @ w.T
        want = y / np.sqrt((y * y).mean(-1, keepdims=True) + 1e-5) * norm
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_host_synchronisation_spoils_the_capture(dev):
    dev.stream.begin_capture()
    with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureUnsupported"):
        dev.synchronize()
    with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureInvalidated"):
        dev.stream.end_capture()
    dev.synchronize()  # the stream works again


@pytest.mark.parametrize("call", ["download", "upload", "copy_to"])
def test_host_device_copies_raise_while_capturing(dev, call):
    a = dev.upload(np.arange(8, dtype=np.float32))
    host = dev.pinned_empty((8,), np.float32)
    host[...] = 1
    calls = {
        "download": lambda: dev.download(a),
        "upload": lambda: dev.upload(host),
        "copy_to": lambda: dev.copy_to(a, host),
    }
    dev.stream.begin_capture()
    try:
        with pytest.raises(RuntimeError, match="the current stream is capturing"):
            calls[call]()
    finally:
        dev.stream.end_capture()


def test_capture_that_allocates_beyond_its_warm_up_fails(dev):
    calls = []

    def grows():  # a new size every call: the capture cannot be handed the warm-up's block
        calls.append(1)
        return dev.empty((len(calls) * 4096,), np.float32)

    with pytest.raises(CaptureAllocationError, match=r"asked for \d+ bytes where the warm-up"):
        dev.capture(grows)
    assert not dev.stream.is_capturing()


# ---- the engine ---------------------------------------------------------------------------------


def prefill(backend, ids):
    from engine.backends.forward_batch import ForwardBatch

    n = len(ids)
    return ForwardBatch(
        np.asarray(ids, np.int32),
        np.arange(n, dtype=np.int32),
        np.arange(n, dtype=np.int32),
        np.arange(cdiv(n, backend.block_size), dtype=np.int32)[None],
        np.array([n], np.int32),
        np.array([0, n], np.int32),
        0,
    )


def test_backend_whose_capture_fails_warns_and_serves_eager(device, tiny, caplog):
    """The decode step's gemm through CuPy's module: the capture fails, the engine says why
    in one warning and runs eager, with the reference's logits."""
    cfg = EngineConfig(max_model_len=64, max_num_seqs=4, dtype="float32").resolve(tiny.config)
    be = CupyBackend(tiny.config, tiny.weights, cfg, device=device)
    be.gemm = lambda x, w, out: cupy_module_gemm(device, x, w, out)
    with caplog.at_level(logging.WARNING, logger="engine.backend"):
        be.allocate_kv_cache(8)
    assert be.graphs == {}
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("CUDA graphs off, running eager: capturing the decode step failed")
    assert "NotImplementedError: calling cuBLAS API during stream capture" in warning
    ids = tiny.tokenizer.encode("hello there")
    got = be.forward(prefill(be, ids))[0]  # (V,)
    want = reference_forward(tiny.weights, tiny.config, ids)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ---- rules only the emulation can break on purpose ----


@pytest.fixture
def emu():
    dev = EmulatedDevice()
    with dev.active():
        yield dev


def test_emulated_allocation_outside_capture_blocks_raises(emu):
    emu.stream.begin_capture()
    try:
        with pytest.raises(CaptureAllocationError, match="while the stream captures"):
            emu.empty((16,), np.float32)
    finally:
        emu.stream.end_capture()


def test_emulated_replay_that_launches_something_else_raises(emu, rng):
    x = emu.upload(rng.standard_normal((4, 32)).astype(np.float32))
    w = emu.upload(np.ones(32, np.float32))
    eps = [1e-5]

    def step():  # reads a host value at every call: a real graph froze it at capture
        out = emu.empty((4, 32), np.float32)
        emu.kernels.rms_norm(out, x, w, eps[0])
        return out

    replay = emu.capture(step)
    replay()  # the same launches: fine
    eps[0] = 1e-3
    with pytest.raises(RuntimeError, match="graph replay differs from its capture at launch 0"):
        replay()


@pytest.mark.parametrize("mistake", ["other stream", "no workspace"])
def test_emulated_cublas_rules_during_capture(emu, rng, mistake):
    from engine.emulation.runtime import EmuStream

    lib = emu.cublas.lib
    if mistake == "other stream":
        cublas = Cublas(lib, EmuStream().ptr, emu.ptr(emu._cublas_workspace), 1 << 20)
    else:
        cublas = Cublas(lib, emu.stream.ptr, 0, 0)  # a zero-size workspace: none
    x, w, x_d, w_d = operands(emu, rng)
    out = emu.empty((9, 48), np.float32)
    plan = gemm_plan(x_d, w_d, out)
    cublas.gemm(plan, emu.ptr(w_d), emu.ptr(x_d), emu.ptr(out))  # eager: fine
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-4, atol=1e-4)
    match = "another stream" if mistake == "other stream" else "without a workspace"
    emu.stream.begin_capture()
    try:
        with pytest.raises(RuntimeError, match=match):
            cublas.gemm(plan, emu.ptr(w_d), emu.ptr(x_d), emu.ptr(out))
    finally:
        emu.stream.end_capture()
