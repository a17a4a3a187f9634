"""The command lines: generate --json, diff, --help."""

from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
import sys

import numpy as np

from engine.config import EngineConfig
from engine.entrypoints.diff import build_parser as diff_parser
from engine.entrypoints.diff import main as diff_main
from engine.entrypoints.engine_args import engine_config, engine_kwargs
from engine.entrypoints.generate import build_parser
from engine.entrypoints.generate import main as generate_main
from engine.golden import golden_logits, read_golden
from engine.tools.bench import build_parser as bench_parser
from reference.generate import generate as reference_generate

ISSUE_FLAGS = """--model --prompt --prompts-file --chat --temperature --top-p --top-k --max-tokens
--seed --ignore-eos --block-size --num-gpu-blocks --max-model-len --max-num-seqs
--max-num-batched-tokens --preemption-mode --swap-space --gpu-memory-utilization --dtype
--backend --json --trace""".split()


def test_generate_json_on_tiny_model(tiny_model_dir, tmp_path, tiny):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi my name is\nhello there\n")
    flags = "--json --max-tokens 8 --ignore-eos --trace --num-gpu-blocks 16 --swap-space 0"
    argv = ["--model", str(tiny_model_dir), "--prompts-file", str(prompts), *flags.split()]
    r = subprocess.run(
        [sys.executable, "-m", "engine.generate", *argv, "--max-model-len", "128"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]  # stdout: only the JSON
    assert [row["prompt"] for row in rows] == ["hi my name is", "hello there"]
    for row in rows:
        keys = "prompt prompt_token_ids text token_ids finish_reason metrics"
        assert set(row) >= set(keys.split())
        ref = reference_generate(tiny.weights, tiny.config, row["prompt_token_ids"], 8)
        assert row["token_ids"] == ref.token_ids and row["finish_reason"] == "length"
        assert row["prompt_token_ids"] == tiny.tokenizer.encode(row["prompt"])
        assert row["metrics"]["ttft"] > 0 and len(row["metrics"]["itl"]) == 7
    assert "# GPU blocks: 16, # CPU blocks: 0" in r.stderr
    assert "scheduled as prefill of 4 tokens with blocks" in r.stderr  # --trace
    assert "its blocks are back on the free queue" in r.stderr
    assert "ITL mean/p50/p99" in r.stderr


def test_generate_text_mode_chat(tiny_model_dir, capsys):
    """--chat shows the user's message as the prompt, not the templated text."""
    flags = "--max-tokens 4 --num-gpu-blocks 32 --swap-space 0 --no-tqdm"
    argv = ["--model", str(tiny_model_dir), "--chat", "--prompt", "hello there", *flags.split()]
    assert generate_main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("'hello there' -> ") and "generated tokens   4" in out
    assert "<|im_start|>" not in out


def test_generate_json_chat_prompt_is_the_users_message(tiny_model_dir, tiny, capsys):
    flags = "--json --max-tokens 3 --num-gpu-blocks 32 --swap-space 0"
    argv = ["--model", str(tiny_model_dir), "--chat", "--prompt", "hello there", *flags.split()]
    assert generate_main(argv) == 0
    row = json.loads(capsys.readouterr().out)
    templated = "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    assert row["prompt"] == "hello there"
    assert row["messages"] == [{"role": "user", "content": "hello there"}]
    assert row["templated_prompt"] == templated
    assert row["prompt_token_ids"] == tiny.tokenizer.encode(templated)


LOGPROB_FLAGS = "--max-tokens 3 --logprobs 2 --num-gpu-blocks 32 --swap-space 0 --no-tqdm"


def test_generate_json_logprobs(tiny_model_dir, tiny, capsys):
    """--json --logprobs: per token the chosen token's logprob and the top 2, decoded, equal to
    the reference's log-softmax."""
    argv = ["--model", str(tiny_model_dir), "--prompt", "hello", "--json", *LOGPROB_FLAGS.split()]
    assert generate_main(argv) == 0
    row = json.loads(capsys.readouterr().out)
    ref = reference_generate(tiny.weights, tiny.config, row["prompt_token_ids"], 3)
    assert len(row["logprobs"]) == 3
    for step, (token_id, entry) in enumerate(zip(row["token_ids"], row["logprobs"], strict=True)):
        logits = ref.logits[step].astype(np.float64)
        want = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        assert entry["token_id"] == token_id
        assert entry["token"] == tiny.tokenizer.decode([token_id], skip_special_tokens=False)
        assert abs(entry["logprob"] - want[token_id]) < 1e-4
        top = entry["top_logprobs"]
        assert [t["token_id"] for t in top] == list(np.argsort(-want)[:2])
        assert top[0]["token_id"] == token_id  # greedy: the chosen token is the most likely
    total = sum(e["logprob"] for e in row["logprobs"])
    assert abs(row["cumulative_logprob"] - total) < 1e-6


def test_generate_text_logprobs(tiny_model_dir, capsys):
    argv = ["--model", str(tiny_model_dir), "--prompt", "hello", *LOGPROB_FLAGS.split()]
    assert generate_main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("  logprobs (cumulative -")
    steps = lines[2:5]
    for i, line in enumerate(steps):
        assert line.split()[0] == str(i) and "  top: " in line
        assert line.split("  top: ")[1].count(", ") == 1  # the top 2


def test_generate_json_logprobs_of_each_sample(tiny_model_dir, capsys):
    flags = "--json --n 2 --temperature 1 --seed 3"
    argv = ["--model", str(tiny_model_dir), "--prompt", "hi", *flags.split()]
    assert generate_main([*argv, *LOGPROB_FLAGS.split()]) == 0
    row = json.loads(capsys.readouterr().out)
    for sample in row["outputs"]:
        assert [e["token_id"] for e in sample["logprobs"]] == sample["token_ids"]
        assert all(len(e["top_logprobs"]) == 2 for e in sample["logprobs"])


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


def test_each_engine_config_field_has_exactly_one_flag():
    """Every EngineConfig field is one flag (--block-size for block_size), listed by --help,
    that parses back into that field; nothing else of the CLI lands on an EngineConfig field."""
    parser = build_parser()
    text = parser.format_help()
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        owners = [a for a in parser._actions if flag in a.option_strings]
        assert len(owners) == 1 and owners[0].dest == f.name, f.name
        assert flag in text and owners[0].help, f.name
        assert sum(a.dest == f.name for a in parser._actions) == 1, f.name


def test_engine_flags_parse_back_into_the_config():
    args = build_parser().parse_args(
        ["--block-size", "8", "--swap-space", "0.5", "--backend", "numpy", "--enforce-eager"]
    )
    assert engine_kwargs(args) == dict(
        block_size=8, swap_space=0.5, backend="numpy", enforce_eager=True
    )
    assert engine_config(args) == EngineConfig(
        block_size=8, swap_space=0.5, backend="numpy", enforce_eager=True
    )
    assert engine_kwargs(build_parser().parse_args([])) == {}


def test_diff_and_bench_take_the_engine_flags_with_their_defaults():
    diff_args = diff_parser().parse_args(["--model", "m", "--block-size", "8"])
    assert engine_kwargs(diff_args) == dict(
        model="m", block_size=8, backend="numpy", dtype="float32", swap_space=0
    )
    bench_args = bench_parser().parse_args(["--seed", "3"])
    assert bench_args.seed == 3 and "seed" not in engine_kwargs(bench_args)  # the workload's
    assert engine_kwargs(bench_args)["model"] == "smollm2"


def test_diff_checks_golden_tokens_and_logits(tiny_model_dir, tmp_path, capsys):
    """With golden data for the prompt, diff passes on the true data and fails on a forgery."""
    golden = read_golden("tiny")
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


def test_bench_replays_the_full_batch_step_against_its_products(tiny_model_dir, capsys):
    """The full-batch decode step, measured in the run and replayed alternately with the
    products alone: both lines carry positive times and a ratio consistent with them."""
    import re

    from engine.tools.bench import main as bench_main

    argv = ["--model", str(tiny_model_dir), "--backend", "cpu", "--num-requests", "6"]
    argv += ["--max-num-seqs", "4", "--min-prompt", "4", "--max-prompt", "12"]
    argv += ["--min-output", "24", "--max-output", "32", "--batch1-tokens", "8"]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"decode steps of all 4 sequences: p50 [\d.]+ ms over [1-9]\d* steps", out)
    m = re.search(
        r"replayed, alternated with the products alone \(10 rounds\): step p50 ([\d.]+) ms, "
        r"products p50 ([\d.]+) ms -> ([\d.]+)x \(rounds ([\d.]+)-([\d.]+)x\)",
        out,
    )
    assert m, out
    step, products, ratio, lo, hi = map(float, m.groups())
    assert step > 0 and products > 0 and lo <= ratio <= hi
