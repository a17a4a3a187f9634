"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official ``openai`` client:
completions and chat (streamed and not), n > 1, stop, seeds, logprobs, greedy text equal to
``LLM.generate``; bad requests and their error bodies; the API key and the queue bound."""

import time
from pathlib import Path

import httpx
import pytest

from engine.frontend.llm import LLM
from engine.sampling_params import SamplingParams
from engine.tools.live_server import MODEL, LiveServer
from tests.utils import SEED_PROMPTS

NO_EOS = {"ignore_eos": True}  # vLLM's extra: every request makes exactly max_tokens tokens


@pytest.fixture(scope="module")
def server(tiny):
    with LiveServer(tiny) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_gpu_blocks=64, max_model_len=256)


def _greedy(llm, prompt, max_tokens=8):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0]


def test_greedy_completion_equals_llm_generate(client, llm):
    for prompt in SEED_PROMPTS:
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body=NO_EOS
        )
        want = _greedy(llm, prompt)
        assert r.choices[0].text == want.text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.usage.completion_tokens == 8


def test_streamed_completion_is_the_same_text(client, llm):
    stream = client.completions.create(
        model=MODEL,
        prompt="hello there",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == _greedy(llm, "hello there").text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_streamed_and_not_equals_llm_chat(client, llm):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.chat(msgs, params, use_tqdm=False)[0].text
    kw = dict(model=MODEL, messages=msgs, max_completion_tokens=6, temperature=0)
    r = client.chat.completions.create(**kw, extra_body=NO_EOS)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body=NO_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_chat_content_parts_are_joined(client):
    parts = [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]
    kw = dict(model=MODEL, max_tokens=4, temperature=0, extra_body=NO_EOS)
    a = client.chat.completions.create(messages=[{"role": "user", "content": parts}], **kw)
    b = client.chat.completions.create(messages=[{"role": "user", "content": "hi there"}], **kw)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_n_and_seed(client):
    kw = dict(model=MODEL, prompt="hi my name is", max_tokens=6, temperature=1.0, n=3)
    a = client.completions.create(**kw, seed=7, extra_body=NO_EOS)
    b = client.completions.create(**kw, seed=7, extra_body=NO_EOS)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 18


def test_stop_string_ends_the_text(client, llm):
    full = _greedy(llm, "today is a beautiful summer day", 12).text
    stop = next(ch for ch in full[2:] if ch != "\ufffd")
    r = client.completions.create(
        model=MODEL,
        prompt="today is a beautiful summer day",
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body=NO_EOS,
    )
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_stop_reason_and_include_stop_str(client, llm):
    prompt = "today is a beautiful summer day"
    full = _greedy(llm, prompt, 12).text
    stop = next(ch for ch in full[2:] if ch != "\ufffd")
    body = {**NO_EOS, "include_stop_str_in_output": True}
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    r = client.completions.create(**kw, extra_body=body)
    choice = r.choices[0]
    assert choice.text == full[: full.index(stop) + 1]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", stop)
    chunks = list(client.completions.create(**kw, stream=True, extra_body=body))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].stop_reason for c in chunks if c.choices][-1] == stop
    r = client.completions.create(**{**kw, "stop": None}, extra_body=NO_EOS)
    assert (r.choices[0].finish_reason, r.choices[0].stop_reason) == ("length", None)
    messages = [{"role": "user", "content": "hi"}]
    c = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body=NO_EOS
    )
    assert c.choices[0].model_extra["stop_reason"] is None


def test_skip_special_tokens_false_is_accepted(client):
    kw = dict(model=MODEL, prompt="hello there", max_tokens=4, temperature=0)
    keep = client.completions.create(**kw, extra_body={**NO_EOS, "skip_special_tokens": False})
    skip = client.completions.create(**kw, extra_body=NO_EOS)
    assert keep.choices[0].finish_reason == skip.choices[0].finish_reason == "length"


def test_logprobs(client):
    r = client.completions.create(
        model=MODEL, prompt="hello there", max_tokens=5, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    c = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=NO_EOS,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy: the top one


def test_models_tokenize_detokenize(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "hello there"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids["tokens"]}).json()
    assert text["prompt"] == "hello there"


GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
IMAGE = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
BAD = [
    ("/v1/completions", b"{not json", "malformed JSON"),
    ("/v1/completions", {**GOOD, "temperature": -1}, "temperature"),
    ("/v1/completions", {**GOOD, "top_p": 2}, "top_p"),
    ("/v1/completions", {**GOOD, "n": 0}, "n must be"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {**GOOD, "prompt": "hi " * 400}, "max_model_len"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [10**6]}, "outside"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 5}, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "content"),
    ("/v1/chat/completions", {**CHAT, "messages": [IMAGE]}, "not supported"),
    ("/v1/completions", {**GOOD, "suffix": "!"}, "suffix"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "top_k": -3}, "top_k"),
]


def test_an_unknown_model_is_404_and_max_tokens_past_the_context_400(server):
    """OpenAI's and vLLM's answers: the openai client raises NotFoundError for a model it
    does not serve; max_tokens that the context cannot hold is refused, never run."""
    import openai

    client = server.openai_client()
    with pytest.raises(openai.NotFoundError, match="The model `gpt-5` does not exist"):
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256 tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=10**12)
    with pytest.raises(openai.BadRequestError, match=r"\(\d+ in the prompt, 300 in the"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=300
        )
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)  # still serving
    assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("path, body, message", BAD)
def test_bad_requests_are_400_and_the_server_keeps_serving(server, path, body, message):
    kw = {"content": body, "headers": {"content-type": "application/json"}}
    r = httpx.post(server.url + path, **(kw if isinstance(body, bytes) else {"json": body}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    assert message in err["message"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.post(server.url + "/v1/completions", json=GOOD).status_code == 200


def test_api_key_and_queue_bound(tiny):
    with LiveServer(tiny, api_key="sekret", max_waiting_requests=0, max_num_seqs=1) as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(s.url + "/v1/completions", json=GOOD, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200
        ok = {"Authorization": "Bearer sekret"}
        assert httpx.get(s.url + "/v1/models", headers=ok).status_code == 200
        url = s.url + "/v1/completions"
        assert httpx.post(url, json=GOOD, headers=ok).status_code == 200  # the free slot runs it
        long = {**GOOD, "max_tokens": 200, "ignore_eos": True, "stream": True}
        s.llm.stat_loggers.append(lambda _stats: time.sleep(0.01))  # 200 steps: 2 s or more
        with httpx.stream("POST", url, json=long, headers=ok) as first:
            lines = first.iter_lines()
            next(lines)  # it holds the one run slot, and nothing may wait
            r = httpx.post(url, json=GOOD, headers=ok)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == 503


def test_a_client_leaving_a_whole_answer_aborts_it(server):
    slow = lambda _stats: time.sleep(0.02)  # noqa: E731 - every step takes 20 ms or more
    server.llm.stat_loggers.append(slow)
    try:
        body = {**GOOD, "max_tokens": 200, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
        deadline = time.monotonic() + 3
        while server.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not server.engine.has_unfinished_requests()  # long before its 200 tokens
    finally:
        server.llm.stat_loggers.remove(slow)


def test_an_unknown_route_names_itself_and_detokenize_keeps_special_tokens(server):
    r = httpx.post(server.url + "/v1/responsez", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert r.json()["error"]["message"] == "POST /v1/responsez: no such route"
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "the route takes POST" in r.json()["error"]["message"]
    tok = server.engine.tokenizer
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == "<|im_start|>user\nhi<|im_end|>"


def test_the_root_names_the_routes_and_docs_load_nothing_from_elsewhere(server):
    """GET / answers a person with the model and the routes to try; /docs lists every route
    (the generation routes among them) without a script or style from another host."""
    root = httpx.get(server.url + "/").json()
    assert root["model"] == MODEL and {"/v1/models", "/health", "/docs"} <= set(root["routes"])
    for path in root["routes"]:  # each named route exists (a GET on a POST route: 405)
        assert httpx.get(server.url + path).status_code in (200, 405), path
    page = httpx.get(server.url + "/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in page.text and "/openapi.json" in page.text
    assert "http://" not in page.text and "https://" not in page.text


def test_a_busy_port_is_refused_before_the_model_loads(capsys):
    import socket

    from engine.entrypoints.serve import main as serve_main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        model = str(Path(__file__).parent / "data/families/llama")
        assert serve_main(["--model", model, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in err
