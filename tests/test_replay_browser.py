"""The HTML replay (engine/frontend/replay.html) in a real headless Chromium, opened from a file://
URL with the network off: no console errors, one grid cell per block, and scrubbing to a step shows
exactly the blocks each sequence held then (the block manager's tables, captured by a spy). With
speculative decoding, every step shows each speculated sequence's drafts as the scheduler
scheduled them, marked as the verifier and the sequence took them (spied on), and the run's
summary line is ``spec_stats``'.

Needs /usr/bin/chromium and /usr/bin/chromedriver (Debian's chromium, chromium-driver; .ci/run
installs them): without them this test fails, it does not skip."""

from __future__ import annotations

import io
import random
import time

import pytest
from PIL import Image
from selenium.webdriver.support.wait import WebDriverWait

from engine.frontend.llm import run_to_completion
from engine.frontend.recorder import Recorder
from tests.browser import chromium
from tests.spies import ScheduleSpy
from tests.test_recorder import stopped_run
from tests.utils import make_engine, shared_prefix_workload

OWNERS_JS = """return Array.from(document.querySelectorAll(arguments[0] + ' .block'),
    (d) => [+d.dataset.block, d.dataset.owner]);"""
SCRUB_JS = """const s = document.getElementById('slider'); s.value = arguments[0];
    s.dispatchEvent(new Event('input'));"""
SPEC_JS = """const s = document.getElementById('slider'), steps = [], struck = new Set();
    for (let f = 0; f < arguments[0]; f++) {  // scrub to each step: its speculated rows
      s.value = f; s.dispatchEvent(new Event('input'));
      steps.push(Array.from(document.querySelectorAll('#specinfo .spec'), (r) => [+r.dataset.seq,
        Array.from(r.querySelectorAll('.tok'), (t) => [t.className.slice(4), t.textContent])]));
      document.querySelectorAll('#specinfo .tok.rej').forEach(
        (t) => struck.add(getComputedStyle(t).textDecorationLine));
    }
    return [steps, Array.from(struck)];"""


@pytest.fixture(scope="module")
def browser():
    driver = chromium("replay-chromium-")
    driver.execute_cdp_cmd("Network.enable", {})
    offline = dict(offline=True, latency=0, downloadThroughput=-1, uploadThroughput=-1)
    driver.execute_cdp_cmd("Network.emulateNetworkConditions", offline)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def replay(tiny, tmp_path_factory):
    """A swap-mode run with preemptions: (html path, spy, block manager)."""
    kw = dict(num_gpu_blocks=14, block_size=4, max_model_len=56, max_num_seqs=6)
    engine = make_engine(tiny, preemption_mode="swap", swap_space=0.00002, **kw)
    recorder, spy = Recorder(engine), ScheduleSpy(engine)
    run_to_completion(engine, *shared_prefix_workload(seed=7))
    assert engine.scheduler.num_preemptions > 0
    path = tmp_path_factory.mktemp("replay") / "run.html"
    recorder.write_html(str(path))
    return path, spy, engine.block_manager


def owners_want(tables: dict[int, list[int]], sids: list[int], n: int) -> list[list[int]]:
    """Per block, the recorder's indices of the sequences whose table holds it."""
    index = {sid: i for i, sid in enumerate(sids)}
    own = [[] for _ in range(n)]
    for sid, table in tables.items():
        for b in table:
            own[b].append(index[sid])
    return [sorted(o) for o in own]


def owners_shown(driver, grid: str) -> list[list[int]]:
    cells = driver.execute_script(OWNERS_JS, grid)
    assert [b for b, _ in cells] == list(range(len(cells)))
    return [sorted(int(i) for i in o.split(",")) if o else [] for _, o in cells]


def test_replay_in_chromium_shows_the_block_managers_tables(browser, replay):
    path, spy, bm = replay
    browser.get(path.as_uri())
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors
    assert len(browser.find_elements("css selector", "#pool .block")) == bm.num_blocks
    assert len(browser.find_elements("css selector", "#cpupool .block")) == bm.num_cpu_blocks
    sids = browser.execute_script("return D.seqs.map((s) => s.sid);")
    rng = random.Random(0)
    swapped = [f for f, s in enumerate(spy.steps) if s["cpu"]]
    assert swapped, "the run swaps"
    for f in sorted({0, len(spy.steps) - 1, swapped[0], *rng.sample(range(len(spy.steps)), 6)}):
        browser.execute_script(SCRUB_JS, f)
        assert browser.execute_script("return +document.body.dataset.frame;") == f
        want = spy.steps[f]
        assert owners_shown(browser, "#pool") == owners_want(want["tab"], sids, bm.num_blocks)
        cpu = owners_want(want["cpu"], sids, bm.num_cpu_blocks)
        assert owners_shown(browser, "#cpupool") == cpu, f"step {f}: CPU pool"
    assert not browser.get_log("browser")


def test_clicking_a_block_shows_its_page_table(browser, replay):
    path, spy, bm = replay
    browser.get(path.as_uri())
    f = max(range(len(spy.steps)), key=lambda k: len(spy.steps[k]["tab"]))
    browser.execute_script(SCRUB_JS, f)
    sid, table = next(iter(spy.steps[f]["tab"].items()))
    browser.find_element("css selector", f'#pool .block[data-block="{table[-1]}"]').click()
    rows = browser.find_elements("css selector", "#pagetable tr")[1:]
    shown = [[int(c.text) for c in r.find_elements("tag name", "td")[:2]] for r in rows]
    assert shown == [[i, b] for i, b in enumerate(table)]
    assert f"(seq {sid})" in browser.find_element("id", "dname").text.lower()
    png = Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB")
    colours = png.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50, "the screenshot is nearly blank"


def test_play_button_steps_through_the_run(browser, replay):
    path, spy, _ = replay
    browser.get(path.as_uri())
    browser.execute_script(SCRUB_JS, 0)
    browser.find_element("id", "play").click()
    frame = "return +document.body.dataset.frame;"
    WebDriverWait(browser, 10).until(lambda d: d.execute_script(frame) >= 3)
    browser.find_element("id", "play").click()  # pause
    paused = browser.execute_script(frame)
    time.sleep(0.5)  # a few play ticks (at most 200 ms each)
    assert 3 <= paused <= len(spy.steps) and browser.execute_script(frame) == paused


@pytest.fixture(scope="module")
def spec_replay(tiny, tmp_path_factory):
    """A run with n-gram drafts, some sequences stopping on an accepted draft: (html path,
    DraftSpy, engine)."""
    engine, recorder, spy = stopped_run(tiny)
    path = tmp_path_factory.mktemp("replay") / "spec.html"
    recorder.write_html(str(path))
    return path, spy, engine


def spec_rows_want(spy, sids: list[int], tokenizer) -> list[list]:
    """Per step, what the page should show of each speculated sequence: (kind, text) per draft
    (accepted, rejected, or unused once the sequence stopped), then its extra token."""

    def text(t):
        return tokenizer.decode([t], False).replace("\n", "↵")

    steps = []
    for rows in spy.steps:
        want = []
        for row in rows:
            drafts, gained = row["drafts"], row["gained"]
            took = min(row["verified"], len(gained))
            cut = len(gained) == took  # it stopped on a draft: nothing after it was taken
            toks = [
                ["acc" if j < took else "unused" if cut else "rej", text(t)]
                for j, t in enumerate(drafts)
            ]
            if not cut:
                toks.append(["bonus" if took == len(drafts) else "fix", text(gained[-1])])
            want.append([sids.index(row["sid"]), toks])
        steps.append(want)
    return steps


def test_replay_shows_each_steps_drafts_as_verified(browser, spec_replay):
    path, spy, engine = spec_replay
    browser.get(path.as_uri())
    sids = browser.execute_script("return D.seqs.map((s) => s.sid);")
    want = spec_rows_want(spy, sids, engine.tokenizer)
    kinds = {k for step in want for _, toks in step for k, _ in toks}
    assert kinds == {"acc", "rej", "unused", "bonus", "fix"}, "the run shows every kind"
    shown, struck = browser.execute_script(SPEC_JS, len(want))
    for f, rows in enumerate(want):
        assert shown[f] == rows, f"step {f}"
    assert struck == ["line-through"], "rejected drafts are struck through"
    stats = engine.spec_stats
    line = browser.find_element("id", "specline").text
    assert f"{stats.num_drafts} drafts of {stats.num_draft_tokens} tokens" in line
    rate = (
        f"{stats.num_accepted_tokens} accepted, acceptance rate {100 * stats.acceptance_rate:.1f}%"
    )
    assert rate in line and f"length {stats.mean_acceptance_length:.2f}" in line
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors
