"""``python -m engine.serve --data-parallel-size 2``: two engine replicas of the tiny model on Ray
Serve (a local instance the server starts, dashboard off), autoscaling up to three, one server
for the module. Through the official openai client the greedy text is one engine's; /metrics
has both replicas' series and the router's counters; a replica killed under load ends its
requests with an error status, never a hang or a short success, the endpoint keeps answering,
Serve restarts the dead replica and the load scales the deployment up to three; SIGTERM lets
the running requests finish. A request whose replica dies before queueing it goes to another."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from engine.frontend.llm import run_to_completion
from engine.sampling_params import SamplingParams
from engine.tools.random_lora import write_random_adapter
from tests.utils import make_engine, patience

PROMPTS = ["hi my name is", "today is a beautiful summer day", "hello there"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tiny, tmp_path_factory):
    """(base url, the server's log path) of a server with two replicas (and a LoRA adapter,
    ``ad``)."""
    port, log = _free_port(), tmp_path_factory.mktemp("dp") / "server.log"
    adapter = write_random_adapter(log.parent / "ad", tiny.config, 4, seed=3)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0"}
    cmd = [sys.executable, "-m", "engine.serve", "--model", str(tiny_model_dir)]
    cmd += ["--data-parallel-size", "2", "--port", str(port), "--backend", "numpy"]
    cmd += ["--enable-prefix-caching", "--max-model-len", "512", "--served-model-name", "tiny"]
    # two sequences run at a time per replica, the rest queue in it: a test that needs requests
    # in flight finds them there for seconds (the tiny model makes 500 tokens in under one)
    cmd += ["--max-num-seqs", "2", "--enable-lora", "--lora-modules", f"ad={adapter}"]
    # autoscaling from 2 up to 3 replicas at 2 requests in flight each, deciding in a second
    fast = {"upscale_delay_s": 0, "metrics_interval_s": 0.5, "look_back_period_s": 1}
    cmd += ["--min-replicas", "2", "--max-replicas", "3", "--target-ongoing-requests", "2"]
    cmd += ["--autoscaling-config", json.dumps(fast)]
    cmd += ["--shutdown-timeout", str(patience(60))]  # the drain test's 150 tokens, under load
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + patience(300)
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"the server did not come up:\n{log.read_text()[-3000:]}")
        yield url, log, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _replica_pids(log) -> set[int]:
    return set(_replica_names(log))


def _replica_names(log) -> dict[int, str]:
    """pid -> the engine name its metrics carry."""
    found = re.findall(r"engine replica (\w+) ready \(pid (\d+)\)", log.read_text())
    return {int(pid): name for name, pid in found}


def _load(url: str) -> dict[str, float]:
    """engine -> its sequences running and waiting, as /metrics shows them (published every
    half second)."""
    text, load = httpx.get(f"{url}/metrics", timeout=10).text, {}
    for kind in ("running", "waiting"):
        found = re.findall(rf'pagedllm:num_requests_{kind}\{{engine="(\w+)"[^}}]*\}} (\S+)', text)
        for e, n in found:
            load[e] = load.get(e, 0.0) + float(n)
    return load


def _wait_until(what: str, check, timeout: float = 60.0) -> None:
    """Poll check() until it is true; fail naming ``what`` after ``timeout`` seconds (stretched
    on a busy machine)."""
    timeout = patience(timeout)
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.1)


def _live_engines(url: str) -> set[str]:
    """The replicas whose metrics /metrics shows (a dead one's leave within seconds)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return set(re.findall(r'pagedllm:num_requests_running\{engine="(\w+)"', text))


def test_a_request_for_an_adapter_runs_it_on_its_replica(server, tiny_model_dir, tiny):
    """``model: ad`` runs the adapter (the text an in-process engine makes with it), routed by
    adapter and prefix like any request."""
    from engine import LLM, LoRARequest, SamplingParams

    url, log, _ = server
    ad = str(log.parent / "ad")
    body = {"prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    got = {m: httpx.post(f"{url}/v1/completions", json={**body, "model": m}, timeout=60).json()
           for m in ("ad", "tiny")}  # fmt: skip
    llm = LLM(model=str(tiny_model_dir), enable_lora=True, num_gpu_blocks=32, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = llm.generate(
        "hello there", params, use_tqdm=False, lora_request=LoRARequest("ad", 1, ad)
    )
    assert got["ad"]["choices"][0]["text"] == want[0].outputs[0].text
    assert got["ad"]["choices"][0]["text"] != got["tiny"]["choices"][0]["text"]
    models = httpx.get(f"{url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny", "ad"] and models[1]["parent"] == "tiny"


def test_the_replicas_answer_one_engines_text(server, tiny):
    from openai import OpenAI

    url, _, _ = server
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].text for o in run_to_completion(make_engine(tiny), PROMPTS, params)]
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    for prompt, text in zip(PROMPTS * 2, want * 2, strict=True):
        r = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].text == text
    chunks = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == want[1]


def test_metrics_show_every_replica_and_the_router(server):
    url, log, _ = server
    deadline = time.monotonic() + patience(30)
    while time.monotonic() < deadline:  # replicas publish their metrics every half second
        engines = _live_engines(url)
        if len(engines) == 2:
            break
        time.sleep(0.5)
    assert len(engines) == 2, engines
    text = httpx.get(f"{url}/metrics", timeout=10).text
    routed = re.findall(
        r'pagedllm:router_requests_total\{engine="(\w+)".*reason="(\w+)"\} (\S+)', text
    )
    assert routed and {e for e, _, _ in routed} <= engines
    assert sum(float(n) for _, _, n in routed) >= 7  # the completions of the test before
    assert {r for _, r, _ in routed} <= {"prefix", "load", "fallback"}
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert len(_replica_pids(log)) == 2


def test_a_killed_replica_fails_its_requests_is_restarted_and_load_scales_up(server):
    """36 requests in flight on two replicas (each runs two at a time, the rest queue in it):
    the one with more is killed. Its requests fail with an error status, the endpoint keeps
    answering, Serve replaces the dead replica and, 12 more requests coming, adds a third:
    four replica processes have started, three are live."""
    url, log, _ = server
    body = {"model": "tiny", "max_tokens": 480, "temperature": 0, "ignore_eos": True}

    def ask(i: int):
        try:
            r = httpx.post(
                f"{url}/v1/completions",
                json={**body, "prompt": f"{i} {PROMPTS[i % 3]}"},
                timeout=60,
            )
        except httpx.HTTPError as e:
            return ("transport", str(e))
        return (r.status_code, r.json())

    pid_of = {name: pid for pid, name in _replica_names(log).items()}
    busiest = []

    def loaded() -> bool:  # a replica with requests beyond the two it runs: queued there
        load = _load(url)
        busiest[:] = [max(load, key=load.get)] if load else []
        return bool(load) and load[busiest[0]] > 2

    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        futures = [pool.submit(ask, i) for i in range(36)]
        # the router decides where requests go: the replica its metrics show with the most,
        # more than it runs at once, is killed (no assumption about the speed or the spread)
        _wait_until("a replica with requests queued", loaded)
        victim = pid_of[busiest[0]]
        os.kill(victim, signal.SIGKILL)
        # more load after the death, so the replicas left stay above their target while Serve
        # decides (the victim had the most: its requests alone may not keep them there)
        more = [pool.submit(ask, i) for i in range(36, 48)]
        results = [f.result(timeout=90) for f in futures]
        later = [f.result(timeout=120) for f in more]
    ok = [r for s, r in results + later if s == 200]
    failed = [(s, r) for s, r in results if s != 200]
    for r in ok:  # a success is whole, never cut short by the death
        assert (
            r["usage"]["completion_tokens"] == 480 and r["choices"][0]["finish_reason"] == "length"
        )
    assert failed, "the killed replica had requests in flight"
    assert all(s in (500, 503) for s, _ in failed), failed
    deadline = time.monotonic() + patience(120)
    while time.monotonic() < deadline:  # the other replica serves now; Serve restarts this one
        r = httpx.post(
            f"{url}/v1/completions", json={**body, "prompt": "after", "max_tokens": 4}, timeout=30
        )
        if r.status_code == 200:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + patience(300)
    upscaled = False
    while time.monotonic() < deadline:  # the restart and the scale-up start in parallel
        pids, engines = _replica_pids(log), _live_engines(url)
        # (Serve's log line of the decision may reach the file after the replica has started)
        upscaled = "Upscaling Deployment(name='engine'" in log.read_text()
        if len(pids) == 4 and len(engines) == 3 and upscaled:
            break
        time.sleep(1.0)
    assert victim in pids and len(pids) == 4, pids
    assert len(engines) == 3, engines
    assert upscaled, "Serve logged no upscaling of the deployment"


def test_a_stop_signal_lets_running_requests_finish(server):
    """SIGTERM: the replicas drain (each request in flight ends whole), then the server exits 0.
    The module's last test on the server."""
    url, _, proc = server
    body = {"model": "tiny", "prompt": "drain", "max_tokens": 150, "temperature": 0}
    body.update(ignore_eos=True, stream=True, stream_options={"include_usage": True})
    started = [threading.Event() for _ in range(3)]

    def stream(i: int) -> tuple[int, int | None]:
        """(status, completion tokens of the final usage chunk) of one streamed request; its
        event is set when the first token has come (the request runs)."""
        usage = None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                started[i].set()
                usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
            started[i].set()  # an error ends the wait too; its status fails the test below
            return r.status_code, usage

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(stream, i) for i in range(3)]
        _wait_until("the three requests' first tokens", lambda: all(e.is_set() for e in started))
        proc.send_signal(signal.SIGTERM)
        results = [f.result(timeout=patience(90)) for f in futures]
    assert results == [(200, 150)] * 3, results
    assert proc.wait(patience(60)) == 0


def test_a_serve_config_file_builds_the_application(tiny_model_dir):
    """deploy/serve_config.yaml's builder: the server's flags as names; a bad one is refused."""
    import yaml
    from ray.serve import Application

    from engine.entrypoints.replicas.deployment import app

    path = Path(__file__).resolve().parents[1] / "deploy" / "serve_config.yaml"
    config = yaml.safe_load(path.read_text())["applications"][0]
    assert config["import_path"] == "engine.entrypoints.replicas.deployment:app"
    args = {**config["args"], "model": str(tiny_model_dir)}
    assert isinstance(app(args), Application)
    with pytest.raises(ValueError, match="--router-imbalance must be >= 0, got -1"):
        app({**args, "router_imbalance": -1})


def test_without_a_model_the_default_is_chosen_once_for_every_replica(tiny_model_dir):
    """No --model: the ingress and the replicas are given the same, resolved name (each
    resolving it alone could differ, and the ingress had no name to tokenize with)."""
    from engine.entrypoints.replicas.deployment import server_options, with_model
    from engine.entrypoints.serve_args import build_parser
    from model_loader.load import default_model

    assert with_model({"model": str(tiny_model_dir)})["model"] == str(tiny_model_dir)
    kwargs = with_model({"backend": "numpy"})
    assert kwargs["model"] == default_model()[0] and kwargs["backend"] == "numpy"
    options = server_options(build_parser().parse_args([]), kwargs, None)
    assert options["model_name"] == kwargs["model"] and options["aliases"] == [kwargs["model"]]


def test_the_ingress_gets_the_chat_format_and_parsers(monkeypatch):
    """--chat-format, --tool-call-parser and --reasoning-parser reach the ingress's app as they
    reach a one-engine server's."""
    from engine.entrypoints import api_server
    from engine.entrypoints.replicas.deployment import Ingress, server_options
    from engine.entrypoints.serve_args import build_parser

    argv = ["--chat-format", "harmony", "--tool-call-parser", "openai"]
    args = build_parser().parse_args([*argv, "--reasoning-parser", "openai_gptoss"])
    options = server_options(args, {"model": "m"}, None)
    seen = {}
    monkeypatch.setattr(api_server, "build_app", lambda *a, **kw: seen.update(kw))
    ingress = object.__new__(Ingress)
    ingress.llm, ingress.server = None, options
    ingress.__serve_build_asgi_app__()
    assert seen["chat_format"] == "harmony" and seen["tool_parser"] == "openai"
    assert seen["reasoning_parser"] == "openai_gptoss"


def test_replica_flags_become_serve_options_and_bad_ones_are_refused():
    """--max-replicas turns on Serve's autoscaler between the bounds, starting at the size; a
    host backend's replicas split the RAM; bad bounds, and a replica flag where it would do
    nothing (one engine, or no autoscaler), are one line."""
    from engine.config import make_config
    from engine.entrypoints.engine_args import engine_kwargs
    from engine.entrypoints.replicas.deployment import (
        engine_deployment_options,
        replica_engine_kwargs,
    )
    from engine.entrypoints.serve_args import build_parser, check_replica_args

    argv = "--data-parallel-size 2 --min-replicas 1 --max-replicas 4 --router round-robin"
    args = build_parser().parse_args(argv.split())
    args.autoscaling_config = '{"upscale_delay_s": 3}'
    config = make_config(data_parallel_size=2, backend="cpu")
    options = engine_deployment_options(args, config, 2, "cpu")
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {
        "min_replicas": 1, "initial_replicas": 2, "max_replicas": 4,
        "target_ongoing_requests": 16.0, "upscale_delay_s": 3,
    }  # fmt: skip
    assert options["request_router_config"].request_router_kwargs["policy"] == "round-robin"
    # each of the 4 replicas there may be: a quarter of the cores, as many kernel threads
    cpus = max(1, (os.cpu_count() or 1) // 4)
    actor = options["ray_actor_options"]
    assert actor["num_cpus"] == cpus and actor["num_gpus"] == 0
    assert actor["runtime_env"] == {"env_vars": {"PAGEDLLM_CPU_THREADS": str(cpus)}}
    config = make_config(data_parallel_size=2, backend="cuda")
    assert engine_deployment_options(args, config, 2, "cuda")["ray_actor_options"] == {
        "num_cpus": cpus, "num_gpus": 1
    }  # fmt: skip
    one = {"backend": "auto", "data_parallel_size": 2}
    kwargs = replica_engine_kwargs(one, 4, 10 << 30, "cpu")  # auto resolved to cpu: a RAM share
    assert kwargs["data_parallel_size"] == 1
    assert kwargs["memory_budget_bytes"] == int(0.9 * (10 << 30) / 4)
    assert "memory_budget_bytes" not in replica_engine_kwargs(one, 4, 10 << 30, "cuda")
    auto = "--data-parallel-size 2 --max-replicas 3 --autoscaling-config"
    bounds = r"--data-parallel-size \(3\) <= --max-replicas \(2\)"
    one = r"--max-replicas \(autoscaling\) needs --data-parallel-size above 1"
    alone = r"needs --data-parallel-size above 1 \(one engine, no replicas\)"
    for argv, message in [
        ("--data-parallel-size 3 --max-replicas 2", bounds),
        ("--max-replicas 2", one),
        ("--router round-robin", f"--router {alone}"),  # one engine: it would be ignored
        ("--router-imbalance 2", f"--router-imbalance {alone}"),
        ("--data-parallel-size 2 --min-replicas 2", r"--min-replicas needs --max-replicas"),
        ("--data-parallel-size 2 --target-ongoing-requests 4", "--target-ongoing-requests needs"),
        ("--data-parallel-size 2 --autoscaling-config {}", "--autoscaling-config needs"),
        (f"{auto} {{", "--autoscaling-config is not JSON"),
        (f"{auto} [1]", "--autoscaling-config must be a JSON object, got list"),
        (f'{auto} {{"max_replicas":3}}', "'max_replicas' is set by --max-replicas, not here"),
        (f'{auto} {{"upscale_delay":1}}', "has no key 'upscale_delay'"),
        (f'{auto} {{"upscale_delay_s":-1}}', "upscale_delay_s: Input should be greater"),
    ]:
        args = build_parser().parse_args(argv.split(maxsplit=6))
        n = make_config(**engine_kwargs(args)).data_parallel_size
        with pytest.raises(ValueError, match=message):
            check_replica_args(args, n)


class _DiesBeforeQueueing:
    """A stand-in for the engine deployment's handle: the first ``dead`` replicas it routes to
    die before their first message; the next one queues the request."""

    def __init__(self, dead: int, error):
        self.dead, self.error, self.sent = dead, error, []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request):
        self.sent.append(request["request_id"])
        return _Response(self.error if len(self.sent) <= self.dead else None)


class _Response:
    def __init__(self, error):
        self.error, self.cancelled = error, False

    def __aiter__(self):
        return self._messages()

    async def _messages(self):
        from engine.entrypoints.replicas.deployment import ACCEPTED

        if self.error is not None:
            raise self.error
        yield ACCEPTED
        yield SimpleNamespace(text="an output", finished=True)

    def cancel(self):
        self.cancelled = True


def test_a_request_whose_replica_dies_before_queueing_it_goes_to_another():
    """Not yet queued: sent again (up to RETRIES times), then a one-line EngineDeadError."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from engine.entrypoints.replicas.deployment import RETRIES, ReplicatedLLM
    from engine.frontend.async_llm import EngineDeadError

    async def start(handle):
        llm = ReplicatedLLM.__new__(ReplicatedLLM)
        llm.handle = handle
        stream = await llm._start("r1", [1, 2, 3], None)
        return [out.text async for out in stream]

    for error in (ActorDiedError(), ActorUnavailableError("replica unreachable", None)):
        handle = _DiesBeforeQueueing(2, error)
        assert asyncio.run(start(handle)) == ["an output"]
        assert handle.sent == ["r1"] * 3
    handle = _DiesBeforeQueueing(RETRIES + 1, ActorDiedError())
    with pytest.raises(EngineDeadError, match="no engine replica took the request"):
        asyncio.run(start(handle))
    assert len(handle.sent) == RETRIES + 1
