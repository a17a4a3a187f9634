"""The benchmarks' ``--plot`` charts (engine/tools/plots.py, bench_plot.py): each file a
real PNG of a sane size that decodes to more than one colour; the batch-1 decode-step split adds
up to the ITL it splits; the concurrency sweeps run the workload once per value."""

import json
import struct

import numpy as np
import pytest
from matplotlib.image import imread

from engine.tools import bench, bench_plot, bench_serve, plots
from engine.tools.bench_plot import OUTSIDE_FORWARD, REST_OF_FORWARD
from engine.tools.live_server import LiveServer
from tests.utils import make_engine

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY_WORKLOAD = ["--num-requests", "5", "--min-prompt", "8", "--max-prompt", "40"]
TINY_WORKLOAD += ["--min-output", "3", "--max-output", "8", "--batch1-tokens", "6"]


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert 300 <= width <= 2000 and 200 <= height <= 1500, (width, height)
    pixels = imread(path)  # (height, width, channels)
    assert pixels.shape[:2] == (height, width)
    colours = np.unique(pixels.reshape(-1, pixels.shape[2]), axis=0)
    assert len(colours) > 16, f"{path.name} is {len(colours)} colours"  # more than a blank frame


def test_each_chart_is_a_png_of_its_data(tmp_path):
    rng = np.random.default_rng(7)
    ttft, itl = rng.lognormal(5, 0.5, 40).tolist(), rng.lognormal(3, 1.5, 400).tolist()  # ms
    a = plots.latency_cdfs(tmp_path / "a.png", ttft, itl, "latency")
    b = plots.latency_cdfs(tmp_path / "b.png", ttft, (np.array(itl) * 3).tolist(), "latency")
    parts = dict(zip(["attention", "norms", "rest"], rng.uniform(1, 20, 3).tolist(), strict=True))
    split = plots.step_split(tmp_path / "split.png", parts, 12.5, "step")
    tok = rng.uniform(50, 400, 4).tolist()
    sweep = plots.throughput_sweep(tmp_path / "sweep.png", [1, 8, 32, 64], tok, "c", "sweep")
    empty = plots.latency_cdfs(tmp_path / "empty.png", [], [], "no samples")
    for path in (a, b, split, sweep, empty):
        assert_png(path)
    assert a.read_bytes() != b.read_bytes()  # the ITL samples are drawn, not a fixed picture


def test_split_parts_add_up_to_the_itl():
    ops_s = {"attention": 0.5, "RMS norms": 0.25}  # seconds summed over the steps
    fwd_s, itl = [0.4, 0.5, 0.6], [0.5, 0.6, 0.7]  # forward and ITL of 3 decode steps
    parts = bench_plot._split_ms(ops_s, fwd_s, itl)
    assert parts["attention"] == pytest.approx(500 / 3)
    assert parts[REST_OF_FORWARD] == pytest.approx((1500 - 750) / 3)
    assert parts[OUTSIDE_FORWARD] == pytest.approx(100.0)
    assert sum(parts.values()) == pytest.approx(1e3 * np.mean(itl))
    with pytest.raises(AssertionError):
        bench_plot._split_ms(ops_s, fwd_s, itl[:2])


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_decode_step_split_times_the_host_ops(tiny, backend):
    engine = make_engine(tiny, backend=backend)
    ops = engine.backend.ops
    seen = []

    def run_engine(eng, prompts, out_lens):  # bench.run_engine, keeping the outputs
        outs, wall = bench.run_engine(eng, prompts, out_lens)
        seen.append(outs)
        return outs, wall

    prompt = np.random.default_rng(3).integers(100, 220, 20).tolist()
    parts = bench_plot.decode_step_split(engine, run_engine, prompt, 12)
    itl = seen[0][0].metrics.itl  # (11,) seconds
    assert sum(parts.values()) == pytest.approx(1e3 * np.mean(itl))
    fused = ["rotary + KV cache writes"] if backend == "cpu" else ["rotary", "KV cache writes"]
    for label in ("attention", "RMS norms", "matrix products", *fused, REST_OF_FORWARD):
        assert parts[label] > 0, label
    assert parts[OUTSIDE_FORWARD] > 0
    assert engine.backend.ops is ops and "forward" not in vars(engine.backend)  # restored
    assert "fuse_decode" not in vars(engine.backend)
    assert getattr(engine.backend, "fuse_decode", backend == "cpu") == (backend == "cpu")


def test_bench_plots_and_sweep(tiny_model_dir, tmp_path, capsys):
    argv = ["--model", str(tiny_model_dir), *TINY_WORKLOAD, "--sweep-concurrency", "1,3"]
    assert bench.main(argv + ["--plot", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    rows = out.split("concurrency  output tok/s")[1].splitlines()[1:3]
    assert [int(r.split()[0]) for r in rows] == [1, 3]
    assert all(float(r.split()[1]) > 0 for r in rows)  # output tok/s
    assert "batch-1 decode step" in out
    names = ["bench_concurrency.png", "bench_decode_step.png", "bench_latency.png"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == names
    for name in names:
        assert_png(tmp_path / "out" / name)


def test_sweep_runs_the_whole_workload_at_each_concurrency(tiny):
    engine = make_engine(tiny)
    args = bench.build_parser().parse_args([*TINY_WORKLOAD, "--seed", "5"])
    prompts, out_lens = bench.workload(args, engine.model_config.vocab_size)
    rows = bench_plot.sweep(engine, bench.run_engine, prompts, out_lens, [2, 5], loaded=tiny)
    assert [r["concurrency"] for r in rows] == [2, 5]
    for r in rows:
        assert r["requests"] == 5 and r["generated_tokens"] == sum(out_lens)
        assert r["prompt_tokens"] == sum(map(len, prompts))
    table = bench_plot.format_sweep(rows).splitlines()
    assert len(table) == 3 and table[2].split()[0] == "5"


def test_bench_plot_flags_fail_in_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert bench.main(["--plot", str(tmp_path / "file" / "sub")]) == 2
    assert capsys.readouterr().err.startswith("error: --plot ")
    with pytest.raises(SystemExit):
        bench.main(["--sweep-concurrency", "1,0"])
    assert "every value must be at least 1" in capsys.readouterr().err


def test_bench_serve_sweeps_concurrency_and_plots(tiny, tmp_path, capsys):
    with LiveServer(tiny) as s:
        argv = ["--url", s.url, "--num-requests", "6", "--max-tokens", "4", "--json"]
        assert bench_serve.main(argv + ["--concurrency", "1,3", "--plot", str(tmp_path)]) == 0
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["concurrency"] for r in runs] == [1, 3]
    assert all(r["generated_tokens"] == 24 and r["failed"] == 0 for r in runs)
    names = ["serve_latency_c1.png", "serve_latency_c3.png", "serve_throughput.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    for name in names:
        assert_png(tmp_path / name)


def test_bench_serve_sweeps_one_list_at_a_time(capsys):
    assert bench_serve.main(["--concurrency", "1,2", "--request-rate", "1,2"]) == 2
    assert "sweep one of them at a time" in capsys.readouterr().err
    assert bench_serve.main(["--request-rate", "2,inf"]) == 2
    assert "a sweep takes finite rates" in capsys.readouterr().err
