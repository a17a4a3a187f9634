"""scripts/gpu_check.sh itself, run on the emulated device as CI does: every stage passes and
leaves the files a GPU run leaves; a stage that cannot run is reported, and the exit says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FILES = ["summary.md", "env.log", "models.log", "smoke.log", "smoke.json", "pytest.log"]
FILES += ["tp.log", "tp.json", "bench.log", "bench.json", "gguf.log", "gguf.json"]
STAGES = ["env", "models", "smoke", "tests", "tp", "bench", "gguf"]
FIGURES = ["device", "copy", "gemm", "load", "itl_graphs", "throughput_graphs"]
FIGURES += ["itl_eager", "throughput_eager"]


def run_check(out: Path, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env}
    env.pop("PAGEDLLM_EMULATE_GPU", None)
    return subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--emulate"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )


@pytest.mark.slow
def test_gpu_check_passes_on_the_emulated_device(tmp_path):
    res = run_check(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FILES)
    summary = (tmp_path / "summary.md").read_text()
    for stage in STAGES:
        assert f"| {stage} | 0 |" in summary
    smoke = json.loads((tmp_path / "smoke.json").read_text())["checks"]
    assert list(smoke) == ["device", "compile", "kernels", "gemm", "graph", "pinned"]
    assert all(c["ok"] for c in smoke.values()), smoke
    bench = json.loads((tmp_path / "bench.json").read_text())
    for name in FIGURES:
        assert "error" not in bench[name], bench[name]
    assert bench["itl_graphs"]["graphs"] == [1] and bench["itl_eager"]["graphs"] == []
    assert bench["throughput_graphs"]["tokens_per_s"] > 0
    assert "passed" in (tmp_path / "pytest.log").read_text()
    tp = json.loads((tmp_path / "tp.json").read_text())
    assert tp["tokens_equal"] == [True] * 3 and tp["max_logit_diff"] < 1e-4
    assert tp["nccl_version"] == "2.30.1" and len(set(tp["collectives_per_rank"])) == 1
    gguf = json.loads((tmp_path / "gguf.json").read_text())
    assert list(gguf["formats"]) == ["q8_0", "q4_0", "q5_0", "q4_k", "q6_k"]
    assert gguf["worst_error"] <= 2e-2


def test_gpu_check_reports_stages_it_could_not_run(tmp_path):
    res = run_check(tmp_path, BUDGET="1")  # one second: the later stages cannot start
    summary = (tmp_path / "summary.md").read_text()
    assert "| bench | skipped (budget spent) | 0 |" in summary
    rows = [line.split("|")[1:3] for line in summary.splitlines() if line.startswith("| ")]
    failed = [name.strip() for name, status in rows[1:] if status.strip() != "0"]
    assert res.returncode == len(failed) >= 1 and "bench" in failed
