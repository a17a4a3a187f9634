"""The cpu backend's float32 products chosen by timing (engine/backends/cpu_tuning.py) and the
kernels' target (PAGEDLLM_CPU_ISA): a shape not whole panels is never given panels, the faster
layout is kept and the measurements are read back rather than taken again, the backend's
tokens are the numpy backend's whichever layout is kept, ``auto`` takes numpy where the cpu
backend's products measured slower, and a target that is not one, or that this CPU cannot run,
is refused by name."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from engine.backends import cpu_native, cpu_tuning
from engine.backends.quant import QuantWeight
from engine.frontend.llm import run_to_completion
from engine.sampling_params import SamplingParams
from tests.utils import SEED_PROMPTS, assert_same_greedy, make_engine


def fake_times(fastest: str) -> dict:
    """Times where `fastest` takes half the others' at every row count."""
    return {c: [(0.5 if c == fastest else 1.0) * m * 1e-4 for m in cpu_tuning.ROWS]
            for c in cpu_tuning.CANDIDATES}  # fmt: skip


@pytest.fixture
def timings(tmp_path, monkeypatch):
    """cpu_tuning with its file in tmp_path and `time_shape` answering from timings["fastest"];
    timings["timed"] lists the shapes it was asked."""
    state = {"fastest": "panels", "timed": [], "file": tmp_path / "products.json"}

    def time_shape(w):
        state["timed"].append(w.shape)
        return fake_times(state["fastest"])

    monkeypatch.setattr(cpu_tuning, "cache_file", lambda: tmp_path / "products.json")
    monkeypatch.setattr(cpu_tuning, "time_shape", time_shape)
    return state


def test_time_shape_measures_every_candidate_and_an_odd_width_never_gets_panels():
    rng = np.random.default_rng()
    even = rng.standard_normal((48, 32), dtype=np.float32)
    times = cpu_tuning.time_shape(even)
    assert set(times) == set(cpu_tuning.CANDIDATES)
    assert all(len(t) == len(cpu_tuning.ROWS) and all(0 < s < 0.1 for s in t)
               for t in times.values())  # fmt: skip
    odd = cpu_tuning.time_shape(rng.standard_normal((48, 20), dtype=np.float32))
    assert odd["panels"] == [float("inf")] * len(cpu_tuning.ROWS)
    assert cpu_tuning._choice(odd).layout == "plain"


def test_the_faster_layout_is_kept_and_measurements_are_read_back(timings):
    mats = {(32, 48): np.ones((32, 48), np.float32), (48, 16): np.ones((48, 16), np.float32)}
    timings["fastest"] = "plain"
    assert {c.layout for c in cpu_tuning.choose(mats).values()} == {"plain"}
    assert sorted(timings["timed"]) == [(32, 48), (48, 16)]
    timings["fastest"] = "panels"  # read back: not timed again, the same answer
    assert {c.layout for c in cpu_tuning.choose(mats).values()} == {"plain"}
    assert len(timings["timed"]) == 2
    wider = {(32, 64): np.ones((32, 64), np.float32)}
    assert cpu_tuning.choose(wider)[(32, 64)].layout == "panels"
    line, vs_numpy = cpu_tuning.summary(cpu_tuning.choose(mats | wider))
    assert "32x64 panels (time 0.50x plain's, 0.50x numpy's)" in line and vs_numpy == pytest.approx(
        0.5
    )


def test_a_shape_timed_slower_than_numpy_is_timed_again_not_kept(timings):
    """A busy machine can make the native threads wait for cores: such a measurement (native
    slower than NumPy) is used but not written, so the next start times the shape again."""
    mats = {(32, 48): np.ones((32, 48), np.float32)}
    timings["fastest"] = "numpy"
    assert cpu_tuning.choose(mats)[(32, 48)].ratio("plain", "numpy") == pytest.approx(2.0)
    assert not timings["file"].exists()
    timings["fastest"] = "plain"  # timed again, and this one is kept
    assert cpu_tuning.choose(mats)[(32, 48)].ratio("plain", "numpy") == pytest.approx(0.5)
    timings["fastest"] = "numpy"
    assert cpu_tuning.choose(mats)[(32, 48)].ratio("plain", "numpy") == pytest.approx(0.5)
    assert timings["timed"] == [(32, 48)] * 2


@pytest.mark.parametrize("fastest", ["panels", "plain"])
def test_the_backend_keeps_the_measured_layout_and_the_numpy_backends_tokens(
    tiny, timings, fastest, monkeypatch
):
    from engine.devices import device as devices

    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    timings["fastest"] = fastest
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = make_engine(tiny, backend="numpy", record_logits=True)
    cpu = make_engine(tiny, backend="cpu", record_logits=True)
    mats = [getattr(lw, n) for lw in cpu.backend.layers for n in ("w_qkv", "w_o", "w_gate_up")]
    if fastest == "panels":
        assert all(isinstance(w, QuantWeight) and w.kind == "panels" for w in mats)
    else:
        assert all(isinstance(w, np.ndarray) and w.dtype == np.float32 for w in mats)
    outs = [run_to_completion(e, SEED_PROMPTS, greedy) for e in (ref, cpu)]
    assert_same_greedy(outs[0], outs[1], tol=1e-4)


def test_auto_takes_numpy_where_the_cpu_products_measured_slower(
    tiny, timings, monkeypatch, caplog, tmp_path
):
    from engine.devices import device as devices

    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    timings["fastest"] = "numpy"
    with caplog.at_level(logging.WARNING, logger="engine.backend"):
        assert make_engine(tiny).backend.name == "numpy"
    assert "backend auto -> numpy: the cpu backend's products measured 2.00x" in caplog.text
    assert make_engine(tiny, backend="cpu").backend.name == "cpu"  # asked by name: kept
    caplog.clear()
    timings["fastest"] = "plain"
    monkeypatch.setattr(cpu_tuning, "cache_file", lambda: tmp_path / "again.json")
    assert make_engine(tiny).backend.name == "cpu"


def test_a_target_that_is_not_one_or_that_this_cpu_cannot_run_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(cpu_native.ISA_ENV, "avx9")
    with pytest.raises(ValueError, match="^PAGEDLLM_CPU_ISA must be one of native, x86-64-v4, "):
        cpu_native.march()
    monkeypatch.setattr(cpu_native.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: "fpu sse sse2 avx avx2 fma f16c")
    monkeypatch.setenv(cpu_native.ISA_ENV, "x86-64-v3")
    with pytest.raises(ValueError, match="^PAGEDLLM_CPU_ISA=x86-64-v3 needs bmi2, which this CPU"):
        cpu_native.march()
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: "avx2 fma f16c bmi2 movbe")
    assert cpu_native.march() == "-march=x86-64-v3"
    monkeypatch.setenv(cpu_native.ISA_ENV, "x86-64-v4")
    with pytest.raises(ValueError, match="^PAGEDLLM_CPU_ISA=x86-64-v4 needs avx512f, which"):
        cpu_native.march()
    monkeypatch.setenv(cpu_native.ISA_ENV, "generic")
    assert cpu_native.march() == "-march=x86-64"
    monkeypatch.setattr(cpu_native.platform, "machine", lambda: "aarch64")
    assert cpu_native.march() == "-march=armv8-a"
    monkeypatch.setenv(cpu_native.ISA_ENV, "x86-64-v3")
    with pytest.raises(ValueError, match="x86-64 target; this CPU is aarch64"):
        cpu_native.march()


@pytest.mark.parametrize("setting", [{"dtype": "bfloat16"}, {"quantization": "q8_0"}])
def test_a_kept_format_is_timed_against_numpy_and_auto_follows(
    tiny, timings, monkeypatch, caplog, setting
):
    from engine.devices import device as devices

    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    state = {"kept": 2.0, "asked": []}

    def time_kept(pair):
        kept, w = pair
        state["asked"].append((kept.kind, w.shape))
        return {"kept": [state["kept"]] * 3, "numpy": [1.0] * 3}

    monkeypatch.setattr(cpu_tuning, "time_kept", time_kept)
    with caplog.at_level(logging.WARNING, logger="engine.backend"):
        assert make_engine(tiny, **setting).backend.name == "numpy"
    assert "the cpu backend's products measured 2.00x NumPy's" in caplog.text
    kinds = {kind for kind, _ in state["asked"]}
    assert kinds == ({"bf16_panels"} if "dtype" in setting else {"q8_0"})
    state["kept"] = 0.5
    monkeypatch.setattr(cpu_tuning, "cache_file", lambda: timings["file"].with_name("b.json"))
    assert make_engine(tiny, **setting).backend.name == "cpu"


def test_a_shape_without_panels_is_summarised():
    """A matrix whose N is not whole panels (an LM head of 327 rows) has no panels timing:
    the summary says so instead of failing on the missing ratio."""
    inf = float("inf")
    c = cpu_tuning.Choice("plain", {"panels": [inf] * 3, "plain": [1.0] * 3, "numpy": [2.0] * 3})
    assert c.ratio("plain", "panels") == 0.0 and c.ratio("panels", "plain") == inf
    line, vs_numpy = cpu_tuning.summary({(64, 327): c})
    assert line == "64x327 plain (no panels for this shape, time 0.50x numpy's)"
    assert vs_numpy == pytest.approx(0.5)
