"""The run recorder (engine/frontend/recorder.py): on random workloads with preemption (recompute
and swap) and prefix caching, the block tables rebuilt from its diffs are the block manager's, step
by step (captured independently by a spy on ``Scheduler.schedule``), and the outputs are the same
with it on and off. With speculative decoding, every recorded draft, accepted count and extra token
is what the scheduler scheduled, the verifier accepted and the sequence took (spied on
``Scheduler.schedule``, ``SpecStats.record`` and ``Scheduler.end_speculation``)."""

from __future__ import annotations

import json
import random
import re

import pytest

from engine import LLMEngine, SamplingParams
from engine.frontend.llm import LLM, run_to_completion
from engine.frontend.recorder import DATA_MARK, Recorder, replay_tables
from tests.spies import ScheduleSpy
from tests.utils import make_engine, shared_prefix_workload

NGRAM = '{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
WORKLOADS = {  # engine args: a pool small enough to preempt
    "recompute": dict(preemption_mode="recompute"),
    "swap": dict(preemption_mode="swap", swap_space=0.00002),  # 10 CPU blocks
    "prefix": dict(preemption_mode="recompute", enable_prefix_caching=True),
    "async": dict(preemption_mode="recompute", async_scheduling=True),  # tokens seen when read
    "spec": dict(  # lookahead blocks taken at schedule, trimmed after the step
        preemption_mode="recompute",
        speculative_config=NGRAM,
    ),
}


class DraftSpy:
    """Wraps ``Scheduler.schedule``, ``SpecStats.record`` and ``Scheduler.end_speculation``: per
    step, one row per speculated sequence (in ``out.scheduled``'s order, the order the engine
    verifies them in) with its drafts, its output before the step, the drafts the verifier
    accepted and the tokens the sequence took (read at the next schedule, or ``settle()``:
    the frontend may have cut them at a stop string after the step)."""

    def __init__(self, engine):
        sched, stats = engine.scheduler, engine.spec_stats
        self._schedule, self._record, self._end = (
            sched.schedule,
            stats.record,
            sched.end_speculation,
        )
        sched.schedule, sched.end_speculation = self.schedule, self.end_speculation
        stats.record = self.record
        self.steps: list[list[dict]] = []

    def settle(self) -> None:
        """The last step's rows: the tokens each sequence kept, and whether it finished."""
        for row in self.steps[-1] if self.steps else ():
            seq = row.pop("seq", None)
            if seq is not None:
                row["gained"] = seq.output_token_ids[len(row["out"]) :]
                row["finished"] = seq.is_finished

    def schedule(self, drafts=None):
        self.settle()
        out = self._schedule(drafts)
        rows = [
            {"sid": s.seq_id, "req": int(s.request_id), "drafts": list(out.drafts[s.seq_id])}
            | {"out": list(s.output_token_ids)}
            for s, _ in out.scheduled
            if s.seq_id in out.drafts
        ]
        self.steps.append(rows)
        self._unverified, self._rows = iter(rows), {r["sid"]: r for r in rows}
        return out

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        row = next(self._unverified)
        assert num_draft_tokens == len(row["drafts"])
        row["verified"] = num_accepted
        self._record(num_draft_tokens, num_accepted)

    def end_speculation(self, seq) -> None:
        self._rows[seq.seq_id]["seq"] = seq
        self._end(seq)


def repeating_workload(seed: int, n: int = 8, stops=None):
    """n prompts that repeat a short pattern (n-gram drafts get accepted), greedy or seeded
    sampling; ``stops``: each request's stop strings."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        prompts.append([rng.randrange(1, 300) for _ in range(rng.randint(2, 5))] * 4)
        temp, stop = rng.choice([0.0, 0.0, 0.8]), stops[i] if stops else None
        kw = dict(temperature=temp, seed=i, stop=stop)
        params.append(SamplingParams(max_tokens=rng.randint(10, 40), **kw))
    return prompts, params


def stops_on_accepted_drafts(spy: DraftSpy, tokenizer, n: int) -> list[list[str]]:
    """Per request, a stop string that ends it on an accepted draft with more accepted after
    it: its whole text up to the first draft of its last step that accepted two or more."""
    stops = [[] for _ in range(n)]
    for row in (r for rows in spy.steps for r in rows):
        if row["verified"] >= 2:
            stops[row["req"]] = [tokenizer.decode(row["out"] + row["drafts"][:1])]
    return stops


def check_speculation(data: dict, spy: DraftSpy, engine) -> None:
    """Every frame's speculated entries are the spy's rows: the scheduled drafts; accepted, the
    drafts the sequence took (the verifier's count, fewer when it stopped on one); the extra
    token, the one it took after them; drop, the accepted drafts no sequence took. The totals
    are ``spec_stats``'."""
    spy.settle()
    frames, sid = data["frames"], [s["sid"] for s in data["seqs"]]
    assert len(frames) == len(spy.steps) + 1 and "spec" not in frames[-1]

    def texts(ids):
        return [engine.tokenizer.decode([t], False) for t in ids]

    for f, rows in enumerate(spy.steps):
        got = frames[f].get("spec", [])
        assert [sid[i] for i, *_ in got] == [r["sid"] for r in rows], f"frame {f}"
        assert [sid[i] for i, _, k in frames[f]["run"] if k == "s"] == [r["sid"] for r in rows]
        drop = 0
        for (i, pieces, accepted, extra), row in zip(got, rows, strict=True):
            verified, gained = row["verified"], row["gained"]
            took = min(verified, len(gained))  # drafts[:verified] and one more, until it ends
            assert len(gained) == verified + 1 or row["finished"], "only an end cuts a run"
            assert pieces == texts(row["drafts"]) and gained[:took] == row["drafts"][:took]
            assert accepted == took, f"frame {f}: seq {sid[i]}"
            taken = pieces[:accepted] + ([] if extra is None else [extra])
            assert taken == texts(gained), f"frame {f}: seq {sid[i]}'s tokens"
            seq = data["seqs"][i]
            assert [t for t, k in zip(seq["out"], seq["ts"], strict=True) if k == f] == taken
            drop += verified - took
        assert frames[f].get("drop", 0) == drop, f"frame {f}: drafts accepted, not taken"
    stats, entries = engine.spec_stats, [e for fr in frames for e in fr.get("spec", [])]
    assert len(entries) == stats.num_drafts
    assert sum(len(e[1]) for e in entries) == stats.num_draft_tokens
    drops = sum(fr.get("drop", 0) for fr in frames)
    assert sum(e[2] for e in entries) + drops == stats.num_accepted_tokens


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
    recorder, spy, spec_spy = Recorder(engine), ScheduleSpy(engine), DraftSpy(engine)
    recorded = run_to_completion(engine, prompts, params, check_invariants=True)
    assert engine.scheduler.num_preemptions > 0  # the workload does preempt
    assert engine.spec_stats.num_drafts > 0 or mode != "spec"  # and speculates
    assert [o.outputs[0].token_ids for o in recorded] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].text for o in recorded] == [o.outputs[0].text for o in plain]
    data = recorder.data()
    check_frames(data, spy, engine.block_manager.num_blocks)
    check_speculation(data, spec_spy, engine)
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


def speculated_run(loaded, stops=None) -> tuple[LLMEngine, Recorder, DraftSpy]:
    """The repeating workload with n-gram drafts, recorded and spied on."""
    kw = dict(num_gpu_blocks=256, block_size=4, max_model_len=96, swap_space=0)
    engine = make_engine(loaded, speculative_config=NGRAM, **kw)
    recorder, spy = Recorder(engine), DraftSpy(engine)
    run_to_completion(engine, *repeating_workload(seed=0, stops=stops), check_invariants=True)
    return engine, recorder, spy


def stopped_run(loaded, first: DraftSpy | None = None) -> tuple[LLMEngine, Recorder, DraftSpy]:
    """The same, with each request that can stopping on an accepted draft (chosen from the
    ``first`` run, run here unless given)."""
    first = first or speculated_run(loaded)[2]
    return speculated_run(loaded, stops_on_accepted_drafts(first, loaded.tokenizer, 8))


@pytest.fixture(scope="module")
def speculated(tiny):
    engine, recorder, spy = speculated_run(tiny)
    return engine, recorder.data(), spy


def test_recorded_drafts_are_the_schedulers_and_the_verifiers(speculated):
    engine, data, spy = speculated
    check_speculation(data, spy, engine)
    entries = [e for f in data["frames"] for e in f.get("spec", [])]
    assert any(0 < a < len(d) for _, d, a, _ in entries), "some drafts accepted, some rejected"
    assert any(a == len(d) for _, d, a, _ in entries), "and some wholly accepted (a bonus)"


def test_a_sequence_that_stops_on_an_accepted_draft_takes_no_more(tiny, speculated):
    engine, recorder, spy = stopped_run(tiny, speculated[2])
    data = recorder.data()
    check_speculation(data, spy, engine)
    cut = [e for f in data["frames"] for e in f.get("spec", []) if e[3] is None]
    assert cut and all(data["seqs"][i]["fin"] == "stop" for i, *_ in cut)
    assert any(f.get("drop", 0) > 0 for f in data["frames"]), "accepted drafts after a stop"


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


def test_trace_html_with_a_core_process_is_refused_by_name(tmp_path, capsys):
    """The replay reads the in-process core's scheduler and pool: refused before any load."""
    from engine.entrypoints.generate import main

    argv = ["--prompt", "hi", "--trace-html", str(tmp_path / "run.html")]
    assert main([*argv, "--engine-core-process"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --trace-html records an in-process engine core: not with --engine-core-process"
    ]
    with pytest.raises(ValueError, match="not with engine_core_process"):
        LLM(trace_html=str(tmp_path / "run.html"), engine_core_process=True)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_a_mixture_of_experts_frames_hold_each_steps_routing(backend):
    """Qwen3-MoE: each frame's ``ex`` is what its step sent to each expert, so a layer's counts
    over the run are the backend's totals, and each step's are top_k times its rows."""
    from tests.test_families import loaded

    m = loaded("qwen3_moe")
    engine = make_engine(m, backend=backend)
    recorder = Recorder(engine)
    prompts = [[random.randrange(3, 320) for _ in range(random.randrange(4, 30))] for _ in range(3)]
    run_to_completion(engine, prompts, SamplingParams(temperature=0.0, max_tokens=6))
    data, k = recorder.data(), m.config.moe.top_k
    assert data["meta"]["experts"]["num"] == m.config.moe.num_experts
    totals = {layer: [0] * m.config.moe.num_experts for layer in data["meta"]["experts"]["layers"]}
    for f in data["frames"]:
        if "run" not in f:
            continue
        rows = sum(n for _, n, _ in f["run"])
        for layer, *pairs in f["ex"]:
            assert sum(pairs[1::2]) == k * rows, f"layer {layer}"
            for e, n in zip(pairs[0::2], pairs[1::2], strict=True):
                totals[layer][e] += n
    assert [[layer, *n] for layer, n in totals.items()] == engine.backend.expert_tokens()


def test_each_kv_groups_tables_are_replayed(monkeypatch):
    """Gemma 3 on its KV groups (a full group and sliding ones of window 8 over 4-token blocks,
    a pool small enough to preempt): every frame's rebuilt tables of every group are the block
    manager's after that step's schedule (a sliding group's given-back blocks -1), the blocks
    they hold together are the pool's held blocks, the meta names each group's window, and the
    live view's pool state carries the same tables."""
    from engine.entrypoints.live_events import meta, pool_state
    from tests.test_families import loaded

    engine = make_engine(
        loaded("gemma3"), backend="numpy", block_size=4, num_gpu_blocks=40, max_model_len=96,
        enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=3,
    )  # fmt: skip
    groups = engine.core.kv_groups
    assert groups.grouped and groups.num_groups > 2
    recorder, spy, live = Recorder(engine), ScheduleSpy(engine), []
    snapshot = spy.snapshot

    def with_groups():
        seqs = engine.scheduler.live_seqs()
        live.append(pool_state(engine.core))
        return snapshot() | {"gtab": {s.seq_id: [list(t) for t in s.group_tables] for s in seqs}}

    monkeypatch.setattr(spy, "snapshot", with_groups)
    rng = random.Random()
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (30, 45, 22, 38)]
    run_to_completion(engine, prompts, SamplingParams(temperature=0.0, max_tokens=12))
    data = recorder.data()
    assert data["meta"]["kv_groups"] == list(groups.windows) == meta(engine.core)["kv_groups"]
    frames, gave_back = data["frames"], False
    for f, want in enumerate(spy.steps):
        tab = by_seq_id(data, replay_tables(frames, f))
        assert tab == want["tab"], f"frame {f}"
        held = {b for t in tab.values() for b in t}
        for g in range(1, groups.num_groups):
            got = by_seq_id(data, replay_tables(frames, f, "tab", group=g))
            wanted = {sid: t[g - 1] for sid, t in want["gtab"].items() if t and t[g - 1]}
            assert got == wanted, f"frame {f}, group {g}"
            held |= {b for t in got.values() for b in t if b >= 0}
            gave_back |= any(b < 0 for t in got.values() for b in t)
        assert held == set(range(engine.block_manager.num_blocks)) - set(want["free"]), f
        sent = {s[0]: s[5] + [b for t in s[7] for b in t] for s in live[f]["seqs"]}
        assert {b for t in sent.values() for b in t if b >= 0} == held, f"live frame {f}"
    assert gave_back  # the sliding groups did give blocks back
