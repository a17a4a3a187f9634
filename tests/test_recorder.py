"""The run recorder (engine/recorder.py): on random workloads with preemption (recompute and swap)
and prefix caching, the block tables rebuilt from its diffs are the block manager's, step by step
(captured independently by a spy on ``Scheduler.schedule``), and the outputs are the same with it
on and off."""

from __future__ import annotations

import json
import re

import pytest

from engine import SamplingParams
from engine.llm import run_to_completion
from engine.recorder import DATA_MARK, Recorder, replay_tables
from tests.spies import ScheduleSpy
from tests.utils import make_engine, shared_prefix_workload

WORKLOADS = {  # engine args: a pool small enough to preempt
    "recompute": dict(preemption_mode="recompute"),
    "swap": dict(preemption_mode="swap", swap_space=0.00002),  # 10 CPU blocks
    "prefix": dict(preemption_mode="recompute", enable_prefix_caching=True),
    "async": dict(preemption_mode="recompute", async_scheduling=True),  # tokens seen when read
    "spec": dict(  # lookahead blocks taken at schedule, trimmed after the step
        preemption_mode="recompute",
        speculative_config='{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}',
    ),
}


def by_seq_id(data: dict, tables: dict[int, list[int]]) -> dict[int, list[int]]:
    return {data["seqs"][i]["sid"]: t for i, t in tables.items()}


def check_frames(data: dict, spy: ScheduleSpy, num_blocks: int) -> None:
    """Every frame's rebuilt tables, free count and scheduled tokens are the spy's."""
    frames, sid = data["frames"], [s["sid"] for s in data["seqs"]]
    assert len(frames) == len(spy.steps) + 1 and frames[-1]["idle"] == 1
    for f, want in enumerate([*spy.steps, spy.snapshot() | {"run": [], "pre": []}]):
        tab = by_seq_id(data, replay_tables(frames, f))
        assert tab == want["tab"], f"frame {f}: GPU tables"
        assert by_seq_id(data, replay_tables(frames, f, "cpu")) == want["cpu"], f"frame {f}: CPU"
        assert frames[f]["free"] == len(want["free"])
        held = {b for t in tab.values() for b in t}
        assert held == set(range(num_blocks)) - set(want["free"]), f"frame {f}: held blocks"
        assert [(sid[i], n) for i, n, _ in frames[f].get("run", [])] == want["run"]
        assert [sid[i] for i, _ in frames[f].get("pre", [])] == want["pre"]


@pytest.mark.parametrize("mode", list(WORKLOADS))
def test_recorded_tables_are_the_block_managers_and_outputs_unchanged(tiny, mode):
    prompts, params = shared_prefix_workload(seed=len(mode))
    kw = dict(num_gpu_blocks=14, block_size=4, max_model_len=56, max_num_seqs=6, **WORKLOADS[mode])
    plain = run_to_completion(make_engine(tiny, **kw), prompts, params)
    engine = make_engine(tiny, **kw)
    recorder, spy = Recorder(engine), ScheduleSpy(engine)
    recorded = run_to_completion(engine, prompts, params, check_invariants=True)
    assert engine.scheduler.num_preemptions > 0  # the workload does preempt
    assert engine.spec_stats.num_drafts > 0 or mode != "spec"  # and speculates
    assert [o.outputs[0].token_ids for o in recorded] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].text for o in recorded] == [o.outputs[0].text for o in plain]
    data = recorder.data()
    check_frames(data, spy, engine.block_manager.num_blocks)
    kinds = {m for f in data["frames"] for _, m in f.get("pre", [])}
    assert ("s" in kinds) == (mode == "swap") and kinds <= {"s", "r"}
    if mode == "prefix":
        hits = [h for f in data["frames"] for h in f.get("hit", [])]
        assert hits and all(n > 0 for _, n in hits)
    for seq, out in zip(data["seqs"], recorded, strict=True):  # one sequence per request
        assert len(seq["out"]) == len(seq["ts"]) == len(out.outputs[0].token_ids)
        pieces = [engine.tokenizer.decode([t], False) for t in out.outputs[0].token_ids]
        assert seq["out"] == pieces
        assert seq["fin"] == out.outputs[0].finish_reason


def test_prompt_pieces_are_the_prompt_tokens(tiny):
    engine = make_engine(tiny)
    recorder = Recorder(engine)
    run_to_completion(engine, ["hello there", "hi my name is"], SamplingParams(max_tokens=3))
    for rid, text in (("0", "hello there"), ("1", "hi my name is")):
        ids = engine.tokenizer.encode(text)
        assert recorder.prompts[rid] == [engine.tokenizer.decode([t], False) for t in ids]


def test_llm_trace_html_writes_one_self_contained_file(tiny_model_dir, tmp_path):
    from engine import LLM

    path = tmp_path / "run.html"
    llm = LLM(str(tiny_model_dir), trace_html=str(path), num_gpu_blocks=16, max_model_len=64)
    llm.generate(["hi my name is", "hello there"], SamplingParams(max_tokens=5), use_tqdm=False)
    html = path.read_text("utf-8")
    assert DATA_MARK not in html
    assert not re.search(r"""(src|href)\s*=|url\(|@import""", html), "loads something"
    blob = html.split('type="application/json">', 1)[1].split("</script>", 1)[0]
    data = json.loads(blob.replace("<\\/", "</"))
    assert data["meta"]["num_blocks"] == 16 and len(data["seqs"]) == 2
    plan = llm.engine.kv_plan
    assert data["plan"]["bytes_per_block"] == plan.bytes_per_block == plan.bytes_per_token * 16


def test_generate_cli_trace_html(tiny_model_dir, tmp_path, capsys):
    from engine.entrypoints.generate import main

    path = tmp_path / "cli.html"
    argv = ["--model", str(tiny_model_dir), "--prompt", "hi", "--max-tokens", "4", "--no-tqdm"]
    sizes = ["--num-gpu-blocks", "12", "--max-model-len", "48"]
    assert main([*argv, "--trace-html", str(path), *sizes]) == 0
    assert '"num_blocks":12' in path.read_text("utf-8")
    assert f"replay: {path}" in capsys.readouterr().err


def test_generate_cli_trace_html_in_a_missing_directory_is_one_line(tmp_path, capsys):
    from engine.entrypoints.generate import main

    path = tmp_path / "nowhere" / "run.html"
    assert main(["--prompt", "hi", "--trace-html", str(path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --trace-html {str(path)!r}: not a file in an existing directory"
    ]
