"""A replay of an engine run: what every step scheduled and how the KV block pool changed, written
as one self-contained HTML file (``LLM(..., trace_html="run.html")``,
``python -m engine.generate --trace-html run.html``).

``Recorder(engine)`` attaches itself as ``engine.frontend.recorder``; the engine then calls
``on_schedule(out)`` once per step, right after ``Scheduler.schedule()``, so the block tables
recorded are the ones the step's forward uses. Each call appends one frame that holds only what
changed since the last one: block-table diffs ``[seq, keep, new blocks]`` (the table is now its
first ``keep`` blocks, then ``new``; a model with KV groups also ``gtab``/``gcpu`` entries
``[seq, group, keep, new blocks]`` for each group after the first, -1 where a sliding group gave
a block back), state changes, the step's scheduled sequences and token
counts, preemptions, swaps, prefix-cache hits, KV-tier loads and stores, the free queue's
length, and the step's wall time (the time to the next frame). Output tokens are seen at the
frame after the step that made them. ``write_html`` first appends an idle frame (the pool once
the run is over), then fills engine/frontend/replay.html with the frames as JSON and with
engine/frontend/pool_view.js (the pool drawing the server's live view shares).

Speculative decoding: a step's ``SchedulerOutput.drafts`` are its frame's ``spec`` entries
``[seq, draft pieces, accepted, extra piece]``, completed at the next frame from the tokens the
sequence gained: the accepted drafts, then one extra token (the bonus after every draft, or the
target's token in place of the first rejected one); the drafts after the accepted ones were
rejected. A sequence that finished on an accepted draft (or whose next row had nothing to
sample) gained no extra token (``null``) and never took the drafts after it, whatever the
verifier made of them; the drafts the verifier accepted but no sequence took are the frame's
``drop`` (from ``engine.spec_stats``), so the frames' accepted drafts and drops add up to
``spec_stats.num_accepted_tokens``. A speculated run is scheduled among the prefills; its
``run`` kind is "s".

Sequences are numbered in the order the recorder first sees them (their index in ``seqs``).
The recorder only reads the engine's state: the outputs are the same with it on or off.
"""

from __future__ import annotations

import dataclasses
import json
import time
from importlib import resources
from pathlib import Path

from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import PENDING_TOKEN, Sequence, SequenceStatus

STATE_LETTER = {
    SequenceStatus.WAITING: "W",
    SequenceStatus.RUNNING: "R",
    SequenceStatus.SWAPPED: "S",
    SequenceStatus.FINISHED: "F",
}
DATA_MARK = "__REPLAY_DATA__"  # where replay.html takes the run's JSON
POOL_MARK = "__POOL_VIEW_JS__"  # where it takes pool_view.js (the drawing the live view shares)


@dataclasses.dataclass
class _Track:
    """What the recorder last recorded of one live sequence."""

    index: int  # in Recorder.seqs
    seq: Sequence
    state: str = ""
    tables: dict[str, list[int]] = dataclasses.field(default_factory=lambda: {"tab": [], "cpu": []})
    num_output: int = 0


@dataclasses.dataclass
class _Speculated:
    """One sequence's drafts in the step just run, completed at the next frame."""

    seq: Sequence
    drafts: list[int]
    num_output: int  # its output tokens before the step
    entry: list  # [seq, draft pieces, accepted, extra piece] in the step's frame


def num_taken(drafts: list[int], gained: list[int], finished: bool) -> int:
    """How many drafts a speculated sequence took, from the tokens it gained in the step: all
    but the last (the extra token); for one that finished in the step, its new tokens while they
    are its drafts (it may have stopped on one, before the extra token; that token is never the
    draft it replaces: greedy, a different argmax; sampled, drawn without the draft)."""
    if not finished:
        return len(gained) - 1
    n = 0
    for draft, token in zip(drafts, gained, strict=False):
        if draft != token:
            break
        n += 1
    return n


def _rows(out: SchedulerOutput) -> list[tuple[Sequence, int, str]]:
    """(seq, tokens, kind) per scheduled row: the first num_decodes are decodes ("d"), then
    prefills ("p"), among which a speculated run (last token and drafts) is "s"."""
    return [
        (s, n, "d" if j < out.num_decodes else "s" if s.seq_id in out.drafts else "p")
        for j, (s, n) in enumerate(out.scheduled)
    ]


def table_diff(old: list[int], new: list[int]) -> tuple[int, list[int]]:
    """(keep, tail): new == old[:keep] + tail, with keep as long as it can be."""
    keep = 0
    for a, b in zip(old, new, strict=False):
        if a != b:
            break
        keep += 1
    return keep, new[keep:]


def replay_tables(
    frames: list[dict], upto: int, key: str = "tab", group: int = 0
) -> dict[int, list[int]]:
    """Every sequence's block table at frame ``upto``, rebuilt from the recorded diffs (what
    the HTML replay does): ``key`` "tab" or "cpu", or with ``group`` > 0 a later KV group's
    ("gtab", "gcpu" entries); sequences with an empty table are left out."""
    tables: dict[int, list[int]] = {}
    for frame in frames[: upto + 1]:
        entries = frame.get(key, []) if group == 0 else frame.get("g" + key[-3:], [])
        for index, *entry in entries:
            if group:
                g, *entry = entry
                if g != group:
                    continue
            keep, tail = entry
            tables[index] = tables.get(index, [])[:keep] + tail
    return {i: t for i, t in tables.items() if t}


class Recorder:
    def __init__(self, engine):
        self.engine = engine
        self.t0 = time.monotonic()
        self.frames: list[dict] = []
        self.seqs: list[dict] = []  # one per sequence seen, in that order
        self.prompts: dict[str, list[str]] = {}  # request id -> prompt tokens as text
        self._live: dict[int, _Track] = {}  # seq_id -> track
        self._pieces: dict[int, str] = {}  # token id -> its text
        self._speculated: list[_Speculated] = []  # the last step's drafts, seen at the next frame
        self._num_accepted = engine.spec_stats.num_accepted_tokens  # at the last frame
        engine.recorder = self  # (refused for a core in another process)
        self._experts = engine.backend.expert_tokens()  # a mixture's router counts so far

    # -- recording ------------------------------------------------------------------------------

    def on_schedule(self, out: SchedulerOutput) -> None:
        """One frame for the step just scheduled (called by ``LLMEngine.step``)."""
        frame = self._frame()
        frame["run"] = [[self._index(s), n, k] for s, n, k in _rows(out)]
        spec = [(s, out.drafts[s.seq_id]) for s, _ in out.scheduled if s.seq_id in out.drafts]
        if spec:
            frame["spec"] = [self._speculate(s, drafts) for s, drafts in spec]
        if out.preempted:
            swapped = SequenceStatus.SWAPPED
            frame["pre"] = [
                [self._index(s), "s" if s.status == swapped else "r"] for s in out.preempted
            ]
        if out.prefix_hits:
            frame["hit"] = [[self._index(s), len(hits)] for s, hits in out.prefix_hits]
        if out.tier_loads:
            frame["tier"] = [[self._index(s), len(ids)] for s, ids, *_ in out.tier_loads]
        if out.blocks_to_store:
            frame["st"] = len(out.blocks_to_store)
        if out.blocks_to_swap_out:
            frame["so"] = len(out.blocks_to_swap_out)
        if out.blocks_to_swap_in:
            frame["si"] = len(out.blocks_to_swap_in)

    def _speculate(self, seq: Sequence, drafts: list[int]) -> list:
        """A speculated sequence's entry; its accepted count and extra token come next frame."""
        entry = [self._index(seq), self._texts(drafts), None, None]
        self._speculated.append(_Speculated(seq, list(drafts), seq.num_output_tokens, entry))
        return entry

    def _complete_speculated(self) -> None:
        """The last step's entries, from the tokens each sequence gained; the drafts the verifier
        accepted (``spec_stats``) that no sequence took are its frame's ``drop``."""
        accepted = self.engine.spec_stats.num_accepted_tokens
        taken = sum(self._complete(sp) for sp in self._speculated)
        drop = accepted - self._num_accepted - taken
        if drop:
            self.frames[-1]["drop"] = drop
        self._speculated, self._num_accepted = [], accepted

    def _complete(self, sp: _Speculated) -> int:
        gained = sp.seq.output_token_ids[sp.num_output :]
        n = num_taken(sp.drafts, gained, sp.seq.is_finished)
        ok = 0 <= n <= len(gained) <= n + 1 and gained[:n] == sp.drafts[:n]
        assert ok, f"{sp.seq}: gained {gained} in a step that verified drafts {sp.drafts}"
        sp.entry[2:] = [n, self._texts(gained[n:])[0] if len(gained) > n else None]
        return n

    def _frame(self) -> dict:
        """A new frame with the time, the pool's counters and every change since the last."""
        self._complete_speculated()  # the step before this frame
        now = time.monotonic()
        if self.frames:
            last = self.frames[-1]
            last["dt"] = round(1e3 * (now - self.t0) - last["t"], 3)
            self._routed(last)
        bm = self.engine.block_manager
        frame = {"t": round(1e3 * (now - self.t0), 3), "free": bm.num_free_blocks}
        if bm.enable_caching:
            frame["cached"] = len(bm.cached)
        self.frames.append(frame)
        self._observe(frame, len(self.frames) - 1)
        return frame

    def _routed(self, frame: dict) -> None:
        """A mixture of experts: the rows the step of ``frame`` sent to each expert, as
        ``ex``: per sparse layer [layer, expert, rows, expert, rows, ...] (nonzero only)."""
        now = self.engine.backend.expert_tokens()
        if now is None:
            return
        frame["ex"] = [
            [layer, *(x for e, (a, b) in enumerate(zip(was, new, strict=True)) if b > a
                      for x in (e, b - a))]
            for (layer, *was), (_, *new) in zip(self._experts, now, strict=True)
        ]  # fmt: skip
        self._experts = now

    def _index(self, seq: Sequence) -> int:
        return self._live[seq.seq_id].index

    def _observe(self, frame: dict, f: int) -> None:
        """Join new sequences; record table, state and output changes; drop finished ones."""
        for seq in self.engine.scheduler.live_seqs():
            if seq.seq_id not in self._live:
                self._join(seq, f)
        changes = {"tab": [], "cpu": [], "gtab": [], "gcpu": [], "st": []}
        for track in list(self._live.values()):
            self._changes(track, changes, f)
        frame.update({k: v for k, v in changes.items() if v})

    def _join(self, seq: Sequence, f: int) -> None:
        if seq.request_id not in self.prompts:
            self.prompts[seq.request_id] = self._texts(seq.prompt_token_ids)
        arrival = round(1e3 * (seq.arrival_time - self.t0), 3)
        row = {
            "req": seq.request_id,
            "sid": seq.seq_id,
            "lora": self._lora_name(seq),
            "arr": arrival,
            "join": f,
            "out": [],
            "ts": [],
        }
        self._live[seq.seq_id] = _Track(len(self.seqs), seq)
        self.seqs.append(row)

    def _lora_name(self, seq: Sequence) -> str | None:
        """The name of seq's LoRA adapter (None: the base model)."""
        lora = getattr(self.engine.core, "lora", None)
        return None if seq.lora_id is None or lora is None else lora.name_of(seq.lora_id)

    def _changes(self, track: _Track, changes: dict, f: int) -> None:
        seq, i = track.seq, track.index
        for key, now in (("tab", seq.block_table), ("cpu", seq.cpu_block_table)):
            if now != track.tables[key]:
                changes[key].append([i, *table_diff(track.tables[key], now)])
                track.tables[key] = list(now)
        # KV groups: each later group's tables, [seq, group, keep, new] (NO_BLOCK: -1)
        for key, tables in (("gtab", seq.group_tables), ("gcpu", seq.cpu_group_tables)):
            known = sum(k.startswith(key) for k in track.tables)  # a freed table is []
            for g in range(1, max(len(tables), known) + 1):
                now = tables[g - 1] if g <= len(tables) else []
                was = track.tables.setdefault(f"{key}{g}", [])
                if now != was:
                    changes[key].append([i, g, *table_diff(was, now)])
                    track.tables[f"{key}{g}"] = list(now)
        state = STATE_LETTER[seq.status]
        if state != track.state:
            changes["st"].append([i, state])
            track.state = state
        known = seq.num_output_tokens - (seq.last_token_id == PENDING_TOKEN)  # async scheduling
        new = seq.output_token_ids[track.num_output : known]
        if new:  # made by the step before this frame
            self.seqs[i]["out"] += self._texts(new)
            self.seqs[i]["ts"] += [f - 1] * len(new)
            track.num_output = known
        if seq.is_finished:
            self.seqs[i] |= {"end": f, "fin": seq.finish_reason}
            del self._live[seq.seq_id]

    def _texts(self, ids: list[int]) -> list[str]:
        """Each token as its own text."""
        tok = self.engine.tokenizer
        for t in ids:
            if t not in self._pieces:
                self._pieces[t] = tok.decode([t], skip_special_tokens=False)
        return [self._pieces[t] for t in ids]

    # -- output ---------------------------------------------------------------------------------

    def data(self) -> dict:
        """The run so far as one JSON-able dict (after an idle frame: the pool as it is now)."""
        self._frame()["idle"] = 1
        self.frames[-1]["dt"] = 0
        return {
            "meta": self._meta(),
            "plan": self._plan(),
            "prompts": self.prompts,
            "seqs": self.seqs,
            "frames": self.frames,
        }

    def _meta(self) -> dict:
        e, cfg = self.engine, self.engine.config
        fields = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
        fields += ("preemption_mode", "enable_prefix_caching", "enable_chunked_prefill")
        meta = {f: getattr(cfg, f) for f in fields}
        bm, sc = e.block_manager, cfg.speculative
        spec = None if sc is None else {"method": sc.method, "k": sc.num_speculative_tokens}
        moe, experts = e.model_config.moe, self._experts
        routed = None if moe is None or experts is None else {
            "num": moe.num_experts, "top_k": moe.top_k, "layers": [row[0] for row in experts]
        }  # fmt: skip
        groups = getattr(e.core, "kv_groups", None)  # per KV group its window (0: full)
        return meta | {
            "kv_groups": list(groups.windows) if groups is not None and groups.grouped else None,
            "model": f"{cfg.model} ({Path(str(e.loaded.source)).name})",
            "backend": e.backend.name,
            "num_blocks": bm.num_blocks,
            "num_cpu_blocks": bm.num_cpu_blocks,
            "speculative": spec,
            "experts": routed,
        }

    def _plan(self) -> dict:
        """The startup arithmetic (engine/core/memory.py's KVPlan) and the terms of bytes per
        token."""
        e, mc = self.engine, self.engine.model_config
        plan = dataclasses.asdict(e.kv_plan) | {"bytes_per_token": e.kv_plan.bytes_per_token}
        terms = {
            "layers": mc.num_hidden_layers,
            "kv_heads": mc.num_key_value_heads,
            "head_dim": mc.head_dim,
            "dtype": e.backend.kv_dtype,
        }
        return plan | terms

    def write_html(self, path: str) -> int:
        """Write the replay to path; returns its size in bytes."""
        here = resources.files("engine.frontend")
        template = here.joinpath("replay.html").read_text("utf-8")
        pool_js = here.joinpath("pool_view.js").read_text("utf-8")
        blob = json.dumps(self.data(), separators=(",", ":"), ensure_ascii=False)
        blob = blob.replace("</", "<\\/")  # no "</script>" inside the script element
        html = template.replace(POOL_MARK, pool_js).replace(DATA_MARK, blob)
        with open(path, "w", encoding="utf-8") as f:
            f.write(html)
        return len(html.encode("utf-8"))
