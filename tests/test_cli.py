"""The command lines: generate --json, diff, --help."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

from engine.diff import golden_logits
from engine.diff import main as diff_main
from engine.generate import build_parser
from engine.generate import main as generate_main
from reference.generate import generate as reference_generate
from reference.loader import load_model

ISSUE_FLAGS = """--model --prompt --prompts-file --chat --temperature --top-p --top-k --max-tokens
--seed --ignore-eos --block-size --num-gpu-blocks --max-model-len --max-num-seqs
--max-num-batched-tokens --preemption-mode --swap-space --gpu-memory-utilization --dtype
--backend --json --trace""".split()


def test_generate_json_on_tiny_model(tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi my name is\nhello there\n")
    r = subprocess.run(
        [sys.executable, "-m", "engine.generate", "--model", str(tiny_model_dir), "--json",
         "--prompts-file", str(prompts), "--max-tokens", "8", "--ignore-eos", "--trace",
         "--num-gpu-blocks", "16", "--swap-space", "0", "--max-model-len", "128"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]  # stdout: only the JSON
    loaded = load_model(str(tiny_model_dir))
    assert [row["prompt"] for row in rows] == ["hi my name is", "hello there"]
    for row in rows:
        assert set(row) >= {"prompt", "prompt_token_ids", "text", "token_ids", "finish_reason",
                            "metrics"}  # fmt: skip
        ref = reference_generate(loaded.weights, loaded.config, row["prompt_token_ids"], 8)
        assert row["token_ids"] == ref.token_ids and row["finish_reason"] == "length"
        assert row["prompt_token_ids"] == loaded.tokenizer.encode(row["prompt"])
        assert row["metrics"]["ttft"] > 0 and len(row["metrics"]["itl"]) == 7
    assert "# GPU blocks: 16, # CPU blocks: 0" in r.stderr
    assert "scheduled as prefill of 4 tokens with blocks" in r.stderr  # --trace
    assert "its blocks are back on the free queue" in r.stderr
    assert "ITL mean/p50/p99" in r.stderr


def test_generate_text_mode_chat(tiny_model_dir, capsys):
    argv = ["--model", str(tiny_model_dir), "--chat", "--prompt", "hello there", "--max-tokens",
            "4", "--num-gpu-blocks", "32", "--swap-space", "0", "--no-tqdm"]  # fmt: skip
    assert generate_main(argv) == 0
    out = capsys.readouterr().out
    assert "<|im_start|>user\\nhello there<|im_end|>" in out and "generated tokens   4" in out


def test_diff_agrees_on_tiny_model(tiny_model_dir, capsys):
    assert diff_main(["--model", str(tiny_model_dir), "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.count("all 6 steps agree") == 3 and "OK: engine == reference" in out


def test_help_lists_every_flag_with_help():
    parser = build_parser()
    text = parser.format_help()
    for flag in ISSUE_FLAGS:
        assert flag in text, flag
    for action in parser._actions:
        assert action.help, action.option_strings


def test_diff_checks_golden_tokens_and_logits(tiny_model_dir, tmp_path, capsys):
    """With golden data for the prompt, diff passes on the true data and fails on a forgery."""
    golden = json.loads((Path(__file__).parent / "golden" / "tiny.json").read_text())
    case = next(c for c in golden["cases"] if c.get("add_special_tokens", True))
    path = tmp_path / "golden.json"
    path.write_text(json.dumps({"cases": [case]}))
    args = ["--model", str(tiny_model_dir), "--prompt", case["prompt"], "--max-tokens", "6"]
    assert diff_main(args + ["--golden", str(path)]) == 0
    assert "golden logits" in capsys.readouterr().out

    forged = dict(case, token_ids=list(case["token_ids"]))
    forged["token_ids"][3] = (forged["token_ids"][3] + 1) % 300  # one wrong token at step 3
    path.write_text(json.dumps({"cases": [forged]}))
    assert diff_main(args + ["--golden", str(path)]) == 1
    assert "first divergence at step 3" in capsys.readouterr().out

    logits = golden_logits(case).copy()
    logits[7] += 0.01  # beyond the 1e-3 absolute bound, tokens unchanged
    bad = dict(case, last_logits_f32_b64=base64.b64encode(logits.tobytes()).decode())
    path.write_text(json.dumps({"cases": [bad]}))
    assert diff_main(args + ["--golden", str(path)]) == 1
    assert "first divergence at step 0" in capsys.readouterr().out
