"""``python -m engine.bench_serve`` against a live server on 127.0.0.1."""

import json

import numpy as np

from engine.tools.bench_serve import arrival_times, main
from engine.tools.live_server import LiveServer


def test_bench_serve_counts_every_token(tiny, capsys):
    with LiveServer(tiny) as s:
        for extra in ([], ["--chat"]):
            argv = ["--url", s.url, "--num-requests", "12", "--concurrency", "4"]
            assert main(argv + ["--max-tokens", "5", "--json", *extra]) == 0
            stats = json.loads(capsys.readouterr().out)
            assert stats["requests"] == 12 and stats["failed"] == 0
            assert stats["generated_tokens"] == 60 and stats["prompt_tokens"] > 0
            assert stats["ttft_ms"][0] > 0


def test_bench_serve_bad_flags_exit_2(capsys):
    assert main(["--num-requests", "0"]) == 2
    assert "--num-requests must be >= 1" in capsys.readouterr().err


def test_poisson_arrivals_have_the_asked_rate():
    starts = arrival_times(4000, 20.0, seed=3)  # (N,) seconds
    gaps = np.diff(starts)
    assert starts[0] == 0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 1 / 20) < 0.005 and abs(gaps.std() - 1 / 20) < 0.005  # exponential
    assert (arrival_times(5, float("inf"), seed=3) == 0).all()
    assert not (arrival_times(50, 20.0, seed=4) == starts[:50]).all()  # the seed matters


def test_bench_serve_at_a_request_rate(tiny, capsys):
    with LiveServer(tiny) as s:
        argv = ["--url", s.url, "--num-requests", "6", "--request-rate", "50", "--json"]
        assert main(argv + ["--max-tokens", "3"]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert stats["requests"] == 6 and stats["generated_tokens"] == 18
    assert main(["--request-rate", "0"]) == 2
    assert "--request-rate must be > 0" in capsys.readouterr().err
