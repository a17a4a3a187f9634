"""``python -m engine.bench_serve`` against a live server on 127.0.0.1."""

import json

from engine.entrypoints.bench_serve import main
from tests.serve_utils import LiveServer


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
