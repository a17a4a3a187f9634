"""Bad input on the command lines: one line on stderr naming the flag (or file) and what is
allowed, exit status 2, never a traceback and never an allocation that cannot succeed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.entrypoints.bench import main as bench_main
from engine.entrypoints.diff import main as diff_main
from engine.entrypoints.generate import main as generate_main

SWAP = "--swap-space: EngineConfig: swap_space must be a number of GiB in [0, 1024] or None"
BAD_ENGINE_FLAGS = [
    ("--swap-space inf", f"{SWAP}, got inf"),
    ("--swap-space nan", f"{SWAP}, got nan"),
    ("--swap-space 1e30", f"{SWAP}, got 1e+30"),
    ("--num-gpu-blocks 100000000", "--num-gpu-blocks: num_gpu_blocks=100000000 x block_size=16"),
    ("--memory-budget-bytes 100000000000000", "--memory-budget-bytes: memory_budget_bytes=10"),
    ("--block-size 100000000 --num-gpu-blocks 1", "--block-size: EngineConfig: block_size must"),
    ("--max-num-seqs 1000000000", "max_num_seqs must be an integer in [1, 65536]"),
]


def one_line_error(capsys, rc: int, named: str) -> str:
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if not line.startswith("INFO ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert named in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("flags, named", BAD_ENGINE_FLAGS)
def test_generate_bad_engine_flags(tiny_model_dir, capsys, flags, named):
    rc = generate_main(["--model", str(tiny_model_dir), "--no-tqdm", *flags.split()])
    one_line_error(capsys, rc, named)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--prompt", "hi \udcff"], "--prompt is not valid UTF-8 (byte 0xff at character 3)"),
        (["--stop", "\udcc3"], "--stop is not valid UTF-8 (byte 0xc3"),
        (["--n", "1000000000"], "--n must be at most --max-num-seqs (256), got 1000000000"),
        (["--n", "5", "--max-num-seqs", "4"], "--n must be at most --max-num-seqs (4), got 5"),
    ],
)
def test_generate_bad_sampling_flags_and_prompts(tiny_model_dir, capsys, argv, named):
    rc = generate_main(["--model", str(tiny_model_dir), "--no-tqdm", *argv])
    one_line_error(capsys, rc, named)


@pytest.mark.parametrize(
    "content, named",
    [
        (b"hello\nhi \xff there\n", "is not valid UTF-8 (byte 0xff on line 2)"),
        (b"", "has no prompts"),
        (b"\n  \n\t\n", "has no prompts"),
        (None, "cannot read it (No such file or directory)"),
    ],
)
def test_generate_bad_prompts_file_is_named(tiny_model_dir, tmp_path, capsys, content, named):
    path = tmp_path / "prompts.txt"
    if content is not None:
        path.write_bytes(content)
    rc = generate_main(["--model", str(tiny_model_dir), "--prompts-file", str(path)])
    line = one_line_error(capsys, rc, named)
    assert f"--prompts-file {str(path)!r}" in line


def test_generate_directory_as_prompts_file(tiny_model_dir, tmp_path, capsys):
    rc = generate_main(["--model", str(tiny_model_dir), "--prompts-file", str(tmp_path)])
    one_line_error(capsys, rc, "cannot read it (Is a directory)")


@pytest.mark.parametrize("flags, named", BAD_ENGINE_FLAGS[::3])
def test_diff_and_bench_bad_engine_flags(tiny_model_dir, capsys, flags, named):
    model = ["--model", str(tiny_model_dir)]
    one_line_error(capsys, diff_main([*model, *flags.split()]), named)
    one_line_error(capsys, bench_main([*model, *flags.split()]), named)


def test_diff_bad_prompt_and_bench_bad_workload(tiny_model_dir, capsys):
    model = ["--model", str(tiny_model_dir)]
    rc = diff_main([*model, "--prompt", "\udcff"])
    one_line_error(capsys, rc, "--prompt is not valid UTF-8 (byte 0xff at character 0)")
    rc = bench_main([*model, "--min-prompt", "10", "--max-prompt", "5"])
    one_line_error(capsys, rc, "--min-prompt: min_prompt (10) is more than max_prompt")
    rc = bench_main([*model, "--num-requests", "0"])
    one_line_error(capsys, rc, "--num-requests: num_requests must be at least 1, got 0")


def test_real_argv_bytes_that_are_not_utf8(tiny_model_dir):
    """Through a real process: the bytes reach Python as surrogate escapes."""
    argv = [sys.executable, "-m", "engine.generate", "--model", str(tiny_model_dir)]
    r = subprocess.run([*argv, "--prompt", b"hi \xff"], capture_output=True, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1, err
    assert err.startswith("error: --prompt is not valid UTF-8 (byte 0xff"), err
