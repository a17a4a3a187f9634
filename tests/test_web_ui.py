"""The web page over HTTP (engine/entrypoints/web_routes.py, live_events.py): the page and its
files with the Content-Security-Policy, no key for them but one for the live events, the flag that
leaves them out, and the live view's frames checked against the engine's own block tables read
on the engine thread as each frame is built. tests/test_web_ui_browser.py drives the page."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from engine.entrypoints.live_events import CLIENT_QUEUE, LiveClient, unavailable
from engine.entrypoints.serve_args import build_parser
from engine.tools.live_server import MODEL, LiveServer
from tests.utils import patience

ROOT = Path(__file__).resolve().parent.parent
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
HTML = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}


@pytest.fixture(scope="module")
def server(tiny):
    with LiveServer(tiny) as s:
        yield s


def chat(max_tokens: int, text: str = "hi") -> dict:
    messages = [{"role": "user", "content": text}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True}


def page_files(html: str) -> list[str]:
    return re.findall(r'(?:src|href)="(/web/[^"]+)"', html)


def test_the_page_and_its_files_come_with_the_csp_and_no_inline_script(server):
    page = httpx.get(server.url + "/", headers=HTML)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CSP
    assert re.findall(r"<script(?![^>]*\bsrc=)[^>]*>", page.text) == [], "an inline script"
    assert " style=" not in page.text and "<style" not in page.text
    files = page_files(page.text)
    assert {"/web/style.css", "/web/app.js", "/web/pool_view.js", "/web/live.js"} <= set(files)
    for path in files:
        r = httpx.get(server.url + path)
        want = "text/css" if path.endswith(".css") else "text/javascript"
        assert r.status_code == 200 and r.headers["content-type"].startswith(want), path
        assert r.headers["content-security-policy"] == CSP, path
        assert "http://" not in r.text and "https://" not in r.text, f"{path}: another host"
        assert ".innerHTML" not in r.text, f"{path}: text must go in as textContent"
    shared = httpx.get(server.url + "/web/pool_view.js").content
    assert shared == (ROOT / "engine/frontend/pool_view.js").read_bytes()  # the replay's drawing
    r = httpx.get(server.url + "/web/nothing.js")
    assert r.status_code == 404 and "nothing.js" in r.json()["error"]["message"]
    api_root = httpx.get(server.url + "/").json()  # an API client still gets the index
    assert api_root["model"] == MODEL


def test_the_config_says_single_user_without_a_key(server):
    config = httpx.get(server.url + "/web/config.json").json()
    assert config == {"model": MODEL, "auth": False, "live": True, "live_why": None}


def test_disable_web_ui_leaves_out_the_page_files_and_events(tiny):
    with LiveServer(tiny, web_ui=False) as s:
        for path in ("/web/app.js", "/web/config.json", "/v1/engine/events"):
            assert httpx.get(s.url + path).status_code == 404, path
        root = httpx.get(s.url + "/", headers=HTML)
        assert root.headers["content-type"] == "application/json"  # the index, not the page
        assert "content-security-policy" not in root.headers
    args = build_parser().parse_args(["--model", "x", "--disable-web-ui"])
    assert args.disable_web_ui and not build_parser().parse_args(["--model", "x"]).disable_web_ui
    assert "--disable-web-ui" in build_parser().format_help()


def test_the_events_need_the_key_and_the_page_does_not(tiny):
    key = f"k{random.randrange(10**9)}"
    with LiveServer(tiny, api_key=key) as s:
        assert httpx.get(s.url + "/v1/engine/events").status_code == 401
        bad = {"Authorization": "Bearer wrong"}
        assert httpx.get(s.url + "/v1/engine/events", headers=bad).status_code == 401
        assert httpx.get(s.url + "/", headers=HTML).status_code == 200
        assert httpx.get(s.url + "/").status_code == 401  # the API index keeps its key
        assert httpx.get(s.url + "/web/app.js").status_code == 200
        assert httpx.get(s.url + "/web/config.json").json()["auth"] is True
        ok = {"Authorization": f"Bearer {key}"}
        with httpx.stream("GET", s.url + "/v1/engine/events", headers=ok, timeout=30) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            name, hello = next(events(r))
        assert name == "hello" and hello["num_blocks"] == s.engine.block_manager.num_blocks


def events(response):
    """(name, data) per server-sent event of a streamed httpx response."""
    name = None
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            yield name, json.loads(line[5:])


class Tables:
    """A stat logger after the tap's: the engine's block tables, read on the engine thread each
    time the tap built a frame, by the frame's step number."""

    def __init__(self, server):
        self.tap, self.engine = server.app.state.live_tap, server.engine
        self.by_step: dict[int, dict] = {}

    def __call__(self, stats) -> None:
        if self.tap.last == stats.now:  # the tap built a frame after this step
            live = self.engine.scheduler.live_seqs()
            self.by_step[self.tap.count] = {s.seq_id: list(s.block_table) for s in live}


def listen(server, frames: list, until) -> threading.Thread:
    """Read the events into ``frames`` [(arrival time, frame)] in a thread until ``until``."""

    def read():
        with httpx.stream("GET", server.url + "/v1/engine/events", timeout=60) as r:
            for name, data in events(r):
                frames.append((time.monotonic(), name, data))
                if name == "frame" and until(data):
                    return

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    deadline = time.monotonic() + patience(10)
    while not frames:  # subscribed once hello came
        assert time.monotonic() < deadline, "no hello"
        time.sleep(0.01)
    return thread


def test_frames_show_a_running_requests_blocks_then_free_them(server):
    assert server.engine.core.recorder is None  # nobody listens: no hook in the engine
    frames, tables = [], Tables(server)
    idle = lambda f: not f["seqs"]  # noqa: E731
    thread = listen(server, frames, lambda f: idle(f) and f["step"] > 0)
    assert server.engine.core.recorder is server.app.state.live_tap
    server.llm.stat_loggers.append(tables)
    try:
        n = random.randrange(30, 60)
        r = httpx.post(server.url + "/v1/chat/completions", json=chat(n), timeout=60)
        thread.join(patience(20))
    finally:
        server.llm.stat_loggers.remove(tables)
    rid = r.json()["id"].removeprefix("chatcmpl-")
    shown = [f for _, name, f in frames if name == "frame"]
    assert shown and idle(shown[-1]), "the last frame is the pool once the request is done"
    assert shown[-1]["free"] == server.engine.block_manager.num_blocks
    held = [s for f in shown for s in f["seqs"] if s[1] == rid]
    assert held and all(s[5] for s in held), "the request's blocks appear while it runs"
    for f in shown:
        assert {s[0]: s[5] for s in f["seqs"]} == tables.by_step[f["step"]], f"step {f['step']}"
        assert "hi" not in json.dumps(f["seqs"]), "no text in a frame"
    steps = [s["n"] for f in shown for s in f["steps"]]
    assert steps == sorted(set(steps)) and len(steps) >= n - 1 - sum(f["dropped"] for f in shown)
    deadline = time.monotonic() + patience(10)  # the client went: the hooks go
    while server.engine.core.recorder is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.engine.core.recorder is None
    assert server.app.state.live_tap not in server.llm.stat_loggers


def test_a_client_gets_at_most_ten_frames_a_second(server):
    frames = []
    thread = listen(server, frames, lambda f: not f["seqs"] and f["step"] > 0)
    slow = lambda _stats: time.sleep(0.004)  # noqa: E731 - 150 steps: 0.6 s or more
    server.llm.stat_loggers.append(slow)
    try:
        httpx.post(server.url + "/v1/chat/completions", json=chat(150), timeout=120)
        thread.join(patience(30))
    finally:
        server.llm.stat_loggers.remove(slow)
    times = [t for t, name, _ in frames if name == "frame"]
    assert len(times) >= 3
    span = times[-1] - times[0]
    assert len(times) - 1 <= span / 0.1 + 1, f"{len(times)} frames in {span:.2f} s: over 10/s"


def test_a_slow_client_loses_the_oldest_frames_not_the_latest():
    rng = random.Random()
    client, sent = LiveClient(), []
    for k in range(CLIENT_QUEUE + rng.randrange(1, 20)):
        frame = {"free": rng.randrange(100), "step": k, "steps": [{"n": k, "run": []}]}
        client.put(frame)
        sent.append(frame)
    got = client.take()
    kept = sent[-CLIENT_QUEUE:]
    assert got["free"] == sent[-1]["free"] and got["step"] == sent[-1]["step"]
    assert got["steps"] == [s for f in kept for s in f["steps"]]
    assert got["dropped"] == len(sent) - CLIENT_QUEUE
    assert not client.ready.is_set() and not client.frames


def test_no_live_view_with_a_core_process_says_why(tiny, tiny_model_dir):
    with LiveServer(tiny, model=str(tiny_model_dir), engine_core_process=True) as s:
        config = httpx.get(s.url + "/web/config.json").json()
        assert config["live"] is False and "--engine-core-process" in config["live_why"]
        with httpx.stream("GET", s.url + "/v1/engine/events", timeout=30) as r:
            got = list(events(r))  # one event, then the stream ends
        assert got == [("hello", {"available": False, "why": config["live_why"]})]
        r = httpx.post(s.url + "/v1/chat/completions", json=chat(3))
        assert r.status_code == 200  # the chat itself works


def test_no_live_view_over_replicas_says_why(tiny_model_dir):
    from engine.entrypoints.replicas.deployment import FrontendView

    view = FrontendView({"model": str(tiny_model_dir)})  # what the ingress holds: no engine
    why = unavailable(SimpleNamespace(engine=view))
    assert why is not None and "--data-parallel-size" in why


def test_a_mixture_of_experts_frames_carry_the_routers_counts():
    """Qwen3-MoE: hello names the experts; the last frame's router counts are the backend's,
    and each sparse layer's rows sum to top_k times the rows the completion ran."""
    from tests.test_families import loaded

    m = loaded("qwen3_moe")
    with LiveServer(m) as s:
        frames = []
        thread = listen(s, frames, lambda f: not f["seqs"] and f["step"] > 0)
        prompt = [random.randrange(3, 320) for _ in range(7)]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "ignore_eos": True}
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code == 200
        thread.join(patience(20))
        want = s.engine.backend.expert_tokens()
    hello = next(f for _, name, f in frames if name == "hello")
    assert hello["experts"] == {"num": m.config.moe.num_experts, "top_k": m.config.moe.top_k}
    last = [f for _, name, f in frames if name == "frame"][-1]
    assert last["experts"] == want
    assert {sum(row[1:]) for row in last["experts"]} == {(7 + 4) * m.config.moe.top_k}
