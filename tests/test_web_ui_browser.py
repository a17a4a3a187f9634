"""The server's web page (engine/entrypoints/web/) in a real headless Chromium against a live
server on the tiny model: a message streamed into the chat, Stop aborting the request in the
engine, model output that looks like HTML shown as text, a reasoning model's thinking folded
apart, the key prompt of a server with --api-key, and the live view showing exactly the engine's
block tables at a step (the engine held there by a stat logger). Every resource the page loads
is this server's.

Needs /usr/bin/chromium and /usr/bin/chromedriver (Debian's chromium, chromium-driver) as
tests/test_replay_browser.py does: without them this test fails, it does not skip."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.wait import WebDriverWait

from engine.tools.live_server import MODEL, LiveServer
from tests.browser import chromium
from tests.scripted import scripted_factory
from tests.test_reasoning import QWEN3, with_template, with_think_tokens
from tests.utils import patience

HTML_LOOKALIKE = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2"> & <b>'
ASSISTANT = "#messages li.assistant"


@pytest.fixture(scope="module")
def browser():
    driver = chromium("webui-chromium-")
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def scripted(tiny):
    """A server whose model writes the script (a reasoning model's template and parser)."""
    script = {"start": 0, "ids": [], "eos": tiny.tokenizer.eos_token_ids[0]}
    loaded = with_template(with_think_tokens(tiny), QWEN3)
    with LiveServer(loaded, reasoning_parser="qwen3", backend_factory=scripted_factory(script),
                    max_model_len=512, num_gpu_blocks=64) as s:  # fmt: skip
        yield s, script, loaded.tokenizer


def wait(driver, until, seconds: float = 20):
    return WebDriverWait(driver, patience(seconds), poll_frequency=0.02).until(until)


def open_page(driver, server):
    driver.get(server.url + "/")
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.get(server.url + "/")
    wait(
        driver,
        lambda d: d.execute_script("return document.querySelectorAll('#model option').length"),
    )


def will_write(server, script, tok, prompt: str, text: str, **fields) -> None:
    """The scripted model answers ``prompt`` (the page's first message, no system prompt, these
    request ``fields``) with ``text``."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], **fields}
    ids = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
    script["start"], script["ids"] = len(ids), tok.encode(text, add_special_tokens=False)


def send(driver, prompt: str) -> None:
    box = driver.find_element("id", "prompt")
    box.send_keys(prompt)
    box.send_keys(Keys.ENTER)  # Enter sends


def answer(driver) -> dict:
    return driver.execute_script(
        """const li = document.querySelector(arguments[0] + ':last-child');
        if (!li) return null;
        const c = li.querySelector('.content'), t = li.querySelector('details.thinking');
        return {text: c.textContent, html: c.innerHTML, stopped: !!li.querySelector('.stopped'),
                thinking: t && t.querySelector('.thought').textContent, open: t && t.open,
                request: (li.querySelector('.show') || {dataset: {}}).dataset.request || null,
                done: document.getElementById('send').disabled === false,
                error: (li.querySelector('.error') || {}).textContent || null};""",
        ASSISTANT,
    )


def no_errors(driver) -> None:
    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors


def only_this_server(driver, server) -> None:
    urls = driver.execute_script(
        "return performance.getEntriesByType('resource').map((e) => e.name);"
    )
    assert urls and all(u.startswith(server.url + "/") for u in urls), urls


def slow_steps(server, seconds: float):
    slow = lambda _stats: time.sleep(seconds)  # noqa: E731
    server.llm.stat_loggers.append(slow)
    return slow


def test_a_message_streams_in_as_markdown(browser, scripted):
    server, script, tok = scripted
    prompt = f"hello {random.randrange(1000)}"
    will_write(server, script, tok, prompt, "Here is **bold** and `code`:\n\n- one\n- two\n" * 3)
    open_page(browser, server)
    assert "Single-user server" in browser.find_element("id", "who").text
    slow = slow_steps(server, 0.03)
    try:
        send(browser, prompt)
        lengths = set()
        while not (got := answer(browser)) or not got["done"]:
            lengths.add(len(got["text"]) if got else 0)
            time.sleep(0.02)
    finally:
        server.llm.stat_loggers.remove(slow)
    assert len(lengths - {0}) >= 2, "the answer grew as it streamed"
    shown = browser.execute_script(
        """const li = document.querySelector(arguments[0] + ':last-child');
        return [Array.from(li.querySelectorAll('.content strong'), (e) => e.textContent),
                Array.from(li.querySelectorAll('.content code'), (e) => e.textContent),
                Array.from(li.querySelectorAll('.content ul li'), (e) => e.textContent)];""",
        ASSISTANT,
    )
    assert shown == [["bold"] * 3, ["code"] * 3, ["one", "two"] * 3]
    before = answer(browser)["text"]
    browser.refresh()  # the conversation is kept in localStorage
    wait(browser, lambda d: (a := answer(d)) and a["text"] == before)
    convs = browser.execute_script(
        "return JSON.parse(localStorage.getItem('pagedllm.conversations'))"
    )
    assert [m["role"] for m in convs[0]["messages"]] == ["user", "assistant"]
    assert convs[0]["messages"][0]["content"] == prompt
    only_this_server(browser, server)
    no_errors(browser)


def test_model_output_that_looks_like_html_is_text(browser, scripted):
    server, script, tok = scripted
    prompt = f"show me {random.randrange(1000)}"
    will_write(server, script, tok, prompt, HTML_LOOKALIKE)
    open_page(browser, server)
    send(browser, prompt)
    wait(browser, lambda d: (a := answer(d)) and a["done"] and a["text"])
    got = answer(browser)
    assert got["text"] == HTML_LOOKALIKE
    assert "<img" not in got["html"] and "<script" not in got["html"]
    assert (
        browser.execute_script(
            "return document.querySelectorAll('#messages img, #messages script').length"
        )
        == 0
    )
    assert browser.execute_script("return window.pwned === undefined")
    no_errors(browser)


def test_a_reasoning_models_thinking_is_folded_apart(browser, scripted):
    server, script, tok = scripted
    prompt = f"count {random.randrange(1000)}"
    will_write(server, script, tok, prompt, "<think>\nLet me count.\n</think>\n\nFive.")
    open_page(browser, server)
    send(browser, prompt)
    wait(browser, lambda d: (a := answer(d)) and a["done"] and a["text"])
    got = answer(browser)
    assert (got["thinking"], got["text"], got["open"]) == ("\nLet me count.\n", "Five.", False)


def test_tool_calls_show_as_they_arrive(browser, scripted):
    server, script, tok = scripted
    prompt, city = f"weather {random.randrange(1000)}", random.choice(["Paris", "Oslo", "Lima"])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    args = {"city": city}
    call = f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(args)}}}\n</tool_call>'
    will_write(server, script, tok, prompt, call, tools=tools)
    open_page(browser, server)
    browser.find_element("id", "tools").send_keys(json.dumps(tools))
    send(browser, prompt)
    wait(browser, lambda d: (a := answer(d)) and a["done"])
    shown = browser.execute_script(
        """const li = document.querySelector(arguments[0] + ':last-child');
        return Array.from(li.querySelectorAll('.toolcall'),
            (c) => [c.querySelector('code').textContent, c.querySelector('pre').textContent]);""",
        ASSISTANT,
    )
    assert [[name, json.loads(a)] for name, a in shown] == [["get_weather", args]]


def test_stop_aborts_the_request_in_the_engine(browser, scripted):
    server, script, tok = scripted
    prompt = f"go on {random.randrange(1000)}"
    will_write(server, script, tok, prompt, "word " * 400)
    open_page(browser, server)
    aborted, abort = [], server.llm.abort
    server.llm.abort = lambda rid: (aborted.append(rid), abort(rid))[1]
    slow = slow_steps(server, 0.03)
    try:
        send(browser, prompt)
        wait(browser, lambda d: (a := answer(d)) and len(a["text"]) > 10)
        browser.find_element("id", "stop").click()
        wait(browser, lambda d: answer(d)["stopped"] and answer(d)["done"])
        deadline = time.monotonic() + patience(10)
        while server.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not server.engine.has_unfinished_requests()
    finally:
        server.llm.stat_loggers.remove(slow)
        del server.llm.abort  # the class's own again
    got = answer(browser)
    assert got["request"] and aborted == [got["request"].removeprefix("chatcmpl-")]
    assert len(got["text"]) < len("word " * 400) - 100, "stopped long before the end"
    assert browser.find_element("id", "status").text == "stopped"


def test_a_server_with_a_key_asks_for_it_once(browser, tiny):
    key = f"key-{random.randrange(10**9)}"
    with LiveServer(tiny, api_key=key) as server:
        browser.get(server.url + "/")
        browser.execute_script("localStorage.clear(); sessionStorage.clear();")
        browser.get(server.url + "/")
        wait(browser, lambda d: d.find_element("id", "keyform").is_displayed())
        assert "needs an API key" in browser.find_element("id", "who").text
        for attempt in ("wrong", key):
            browser.find_element("id", "keyinput").send_keys(attempt, Keys.ENTER)
            if attempt == "wrong":
                wait(browser, lambda d: "refused" in d.find_element("id", "keyerror").text)
        wait(browser, lambda d: not d.find_element("id", "keyform").is_displayed())
        assert browser.execute_script("return localStorage.getItem('pagedllm.apiKey')") == key
        browser.get(server.url + "/")  # asked once: the next visit uses the kept key
        wait(
            browser,
            lambda d: d.execute_script("return document.querySelectorAll('#model option').length"),
        )
        assert not browser.find_element("id", "keyform").is_displayed()
        browser.find_element("id", "max_tokens").send_keys("8")
        send(browser, "hi")
        wait(browser, lambda d: (a := answer(d)) and a["done"] and a["request"])
        no_errors_but_the_refused_key(browser)


def no_errors_but_the_refused_key(driver) -> None:
    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert all("401" in e["message"] for e in errors), errors


class Hold:
    """A stat logger after the live view's tap: holds the engine thread right after the tap built
    a frame, once ``arm`` is set, until ``release``; ``tables``: the engine's tables then."""

    def __init__(self, server):
        self.tap, self.engine = server.app.state.live_tap, server.engine
        self.arm, self.held, self.release = threading.Event(), threading.Event(), threading.Event()
        self.tables, self.step = {}, None

    def __call__(self, stats) -> None:
        if self.arm.is_set() and self.tap.last == stats.now and stats.num_running:
            live = self.engine.scheduler.live_seqs()
            self.tables = {s.seq_id: list(s.block_table) for s in live if s.block_table}
            self.step = self.tap.count
            self.arm.clear()
            self.held.set()
            self.release.wait(patience(30))


def test_the_live_view_draws_the_engines_blocks(browser, scripted):
    server, script, tok = scripted
    prompt = f"tell me {random.randrange(1000)}"
    will_write(server, script, tok, prompt, "word " * 300)
    open_page(browser, server)
    hold, slow = Hold(server), slow_steps(server, 0.01)
    try:
        send(browser, prompt)
        wait(browser, lambda d: (a := answer(d)) and a["request"] and len(a["text"]) > 40)
        show = f"{ASSISTANT}:last-child .show"  # redrawn as the answer grows: found, then clicked
        browser.execute_script("document.querySelector(arguments[0]).click();", show)
        wait(browser, lambda d: d.execute_script("return +document.body.dataset.liveStep || 0") > 0)
        server.llm.stat_loggers.append(hold)  # after the tap, which the live view subscribed
        hold.arm.set()
        assert hold.held.wait(patience(20))
        wait(
            browser,
            lambda d: d.execute_script("return +document.body.dataset.liveStep") == hold.step,
        )
        shown = browser.execute_script(
            """return Array.from(document.querySelectorAll('#live-pool .block'),
                (d) => [+d.dataset.block, d.dataset.owner, d.classList.contains('sel')]);"""
        )
        rows = browser.find_elements("css selector", "#live-pagetable tr")[1:]
        table = [[int(c.text) for c in r.find_elements("tag name", "td")[:2]] for r in rows]
    finally:
        hold.release.set()
        server.llm.stat_loggers[:] = [x for x in server.llm.stat_loggers if x not in (hold, slow)]
        browser.find_element("id", "tab-chat").click()
        browser.find_element("id", "stop").click()
    owners = {b: [int(i) for i in o.split(",")] for b, o, _ in shown if o}
    want = {b: [sid] for sid, tab in hold.tables.items() for b in tab}
    assert owners == want
    ((sid, mine),) = hold.tables.items()  # the one request: it is the selected one
    assert table == [[i, b] for i, b in enumerate(mine)]
    assert sorted(b for b, _, sel in shown if sel) == sorted(mine)
    only_this_server(browser, server)


def test_keyboard_tabs_phone_width_and_dark_mode(browser, scripted):
    server, _, _ = scripted
    open_page(browser, server)
    browser.find_element("id", "tab-chat").send_keys(Keys.ARROW_RIGHT)
    assert browser.switch_to.active_element.get_attribute("id") == "tab-live"
    assert browser.find_element("id", "view-live").is_displayed()
    assert not browser.find_element("id", "view-chat").is_displayed()
    browser.switch_to.active_element.send_keys(Keys.ARROW_LEFT)
    assert browser.find_element("id", "view-chat").is_displayed()
    unlabeled = browser.execute_script(
        """return Array.from(document.querySelectorAll('input, select, textarea'))
            .filter((e) => !e.labels.length).map((e) => e.id);"""
    )
    assert unlabeled == []
    browser.set_window_size(390, 844)
    try:
        browser.refresh()
        wide = "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
        assert browser.execute_script(wide) <= 0, "no sideways scrolling at phone width"
    finally:
        browser.set_window_size(1400, 1100)
    background = "return getComputedStyle(document.body).backgroundColor"
    light = browser.execute_script(background)
    dark = {"media": "", "features": [{"name": "prefers-color-scheme", "value": "dark"}]}
    browser.execute_cdp_cmd("Emulation.setEmulatedMedia", dark)
    try:
        shade = browser.execute_script(background)
    finally:
        browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"media": "", "features": []})
    assert light == "rgb(246, 247, 249)" and shade == "rgb(20, 23, 29)"
