"""Bad input on the command lines: one line on stderr naming the flag (or file) and what is
allowed, exit status 2, never a traceback and never an allocation that cannot succeed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.entrypoints.diff import main as diff_main
from engine.entrypoints.engine_args import check_backend
from engine.entrypoints.generate import main as generate_main
from engine.entrypoints.serve import main as serve_main
from engine.tools.bench import main as bench_main

MAINS = {"generate": generate_main, "diff": diff_main, "bench": bench_main, "serve": serve_main}

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


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model fails the test: the checks must come before it."""

    def load(*args, **kwargs):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr("engine.frontend.llm_engine.load_model", load)
    monkeypatch.setattr("engine.entrypoints.diff.load_model", load)


@pytest.mark.parametrize("cli", sorted(MAINS))
def test_missing_model_path_before_loading(cli, tmp_path, capsys, no_model_load):
    rc = MAINS[cli](["--model", str(tmp_path / "nope")])
    line = one_line_error(capsys, rc, f"--model {str(tmp_path / 'nope')!r}: no such file")
    assert "a .gguf file, or 'smollm2'" in line


@pytest.mark.parametrize("cli", sorted(MAINS))
def test_model_dir_without_config_before_loading(cli, tmp_path, capsys, no_model_load):
    rc = MAINS[cli](["--model", str(tmp_path)])
    one_line_error(capsys, rc, f"--model {str(tmp_path)!r}: directory has no config.json; pass")


@pytest.mark.parametrize("cli", sorted(MAINS))
def test_backend_cuda_without_gpu_before_loading(
    cli, tiny_model_dir, capsys, monkeypatch, no_model_load
):
    monkeypatch.setattr("engine.devices.device.gpu_status", lambda: (0, "no driver"))
    rc = MAINS[cli](["--model", str(tiny_model_dir), "--backend", "cuda"])
    line = one_line_error(capsys, rc, "--backend cuda needs a GPU that CuPy can see")
    assert "(no driver); use --backend auto, numpy or cuda-cpu" in line


def test_backend_cuda_with_a_gpu_passes_the_check(monkeypatch):
    monkeypatch.setattr("engine.devices.device.gpu_status", lambda: (1, ""))
    check_backend("cuda")
    monkeypatch.setattr("engine.devices.device.gpu_status", lambda: (0, "none"))
    for name in ("auto", "numpy", "cuda-cpu"):
        check_backend(name)  # only cuda asks for a GPU


def test_missing_prompts_file_before_loading(tiny_model_dir, tmp_path, capsys, no_model_load):
    path = tmp_path / "missing.txt"
    rc = generate_main(["--model", str(tiny_model_dir), "--prompts-file", str(path)])
    one_line_error(capsys, rc, f"--prompts-file {str(path)!r}: cannot read it")


@pytest.mark.parametrize(
    "flags, named",
    [
        ("--num-requests 0", "--num-requests: num_requests must be at least 1, got 0"),
        ("--min-prompt 50 --max-prompt 10", "--min-prompt: min_prompt (50) is more than max"),
        ("--min-output 9 --max-output 3", "--min-output: min_output (9) is more than max_output"),
    ],
)
def test_bench_bad_workload_before_loading(tiny_model_dir, capsys, no_model_load, flags, named):
    rc = bench_main(["--model", str(tiny_model_dir), *flags.split()])
    one_line_error(capsys, rc, named)


def test_bench_refuses_the_device_backends_by_name(tiny_model_dir, capsys, no_model_load):
    """engine.bench times host products; on cuda-cpu it would crash after the run."""
    from engine.tools.bench import main as bench_main

    rc = bench_main(["--model", str(tiny_model_dir), "--backend", "cuda-cpu"])
    line = one_line_error(capsys, rc, "--backend cuda-cpu is not timed here")
    assert "python -m engine.tools.bench_gpu times the device backends" in line
