"""``python -m engine.serve --data-parallel-size 2``: two engine replicas of the tiny model on Ray
Serve (a local instance the server starts, dashboard off), one server for the module. Through
the official openai client the greedy text is one engine's; /metrics has both replicas' series
and the router's counters; a replica killed under load ends its requests with an error status,
never a hang or a short success, and the endpoint keeps answering; SIGTERM lets the running
requests finish."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.llm import run_to_completion
from engine.sampling_params import SamplingParams
from tests.utils import make_engine

PROMPTS = ["hi my name is", "today is a beautiful summer day", "hello there"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """(base url, the server's log path) of a server with two replicas."""
    port, log = _free_port(), tmp_path_factory.mktemp("dp") / "server.log"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0"}
    cmd = [sys.executable, "-m", "engine.serve", "--model", str(tiny_model_dir)]
    cmd += ["--data-parallel-size", "2", "--port", str(port), "--backend", "numpy"]
    cmd += ["--enable-prefix-caching", "--max-model-len", "256", "--served-model-name", "tiny"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
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
    return {int(p) for p in re.findall(r"engine replica \w+ ready \(pid (\d+)\)", log.read_text())}


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
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # replicas publish their metrics every half second
        text = httpx.get(f"{url}/metrics", timeout=10).text
        engines = set(re.findall(r'pagedllm:num_requests_running\{engine="(\w+)"', text))
        if len(engines) == 2:
            break
        time.sleep(0.5)
    assert len(engines) == 2, text[-2000:]
    routed = re.findall(
        r'pagedllm:router_requests_total\{engine="(\w+)".*reason="(\w+)"\} (\S+)', text
    )
    assert routed and {e for e, _, _ in routed} <= engines
    assert sum(float(n) for _, _, n in routed) >= 7  # the completions of the test before
    assert {r for _, r, _ in routed} <= {"prefix", "load", "fallback"}
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert len(_replica_pids(log)) == 2


def test_a_killed_replica_fails_its_requests_and_the_endpoint_keeps_answering(server):
    url, log, _ = server
    body = {"model": "tiny", "max_tokens": 200, "temperature": 0, "ignore_eos": True}

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

    victim = sorted(_replica_pids(log))[0]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(ask, i) for i in range(12)]
        time.sleep(1.5)
        os.kill(victim, signal.SIGKILL)
        results = [f.result(timeout=90) for f in futures]
    ok = [r for s, r in results if s == 200]
    failed = [(s, r) for s, r in results if s != 200]
    for r in ok:  # a success is whole, never cut short by the death
        assert (
            r["usage"]["completion_tokens"] == 200 and r["choices"][0]["finish_reason"] == "length"
        )
    assert failed, "the killed replica had requests in flight"
    assert all(s in (500, 503) for s, _ in failed), failed
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the other replica serves now; Serve restarts this one
        r = httpx.post(
            f"{url}/v1/completions", json={**body, "prompt": "after", "max_tokens": 4}, timeout=30
        )
        if r.status_code == 200:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text


def test_a_stop_signal_lets_running_requests_finish(server):
    """SIGTERM: the replicas drain (each request in flight ends whole), then the server exits 0.
    The module's last test on the server."""
    url, _, proc = server
    body = {"model": "tiny", "prompt": "drain", "max_tokens": 150, "temperature": 0}
    body["ignore_eos"] = True
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        post = lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=60)  # noqa: E731
        futures = [pool.submit(post) for _ in range(3)]
        time.sleep(1.0)  # they run
        proc.send_signal(signal.SIGTERM)
        responses = [f.result(timeout=90) for f in futures]
    for r in responses:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 150
    assert proc.wait(60) == 0


def test_a_serve_config_file_builds_the_application(tiny_model_dir):
    """deploy/serve_config.yaml's builder: the server's flags as names; a bad one is refused."""
    import yaml
    from ray.serve import Application

    from engine.distributed.replicas import app

    path = Path(__file__).resolve().parents[1] / "deploy" / "serve_config.yaml"
    config = yaml.safe_load(path.read_text())["applications"][0]
    assert config["import_path"] == "engine.distributed.replicas:app"
    args = {**config["args"], "model": str(tiny_model_dir)}
    assert isinstance(app(args), Application)
    with pytest.raises(ValueError, match="--router-imbalance must be >= 0, got -1"):
        app({**args, "router_imbalance": -1})


def test_without_a_model_the_default_is_chosen_once_for_every_replica(tiny_model_dir):
    """No --model: the ingress and the replicas are given the same, resolved name (each
    resolving it alone could differ, and the ingress had no name to tokenize with)."""
    from engine.distributed.replicas import server_options, with_model
    from engine.entrypoints.serve import build_parser
    from reference.loader import default_model

    assert with_model({"model": str(tiny_model_dir)})["model"] == str(tiny_model_dir)
    kwargs = with_model({"backend": "numpy"})
    assert kwargs["model"] == default_model()[0] and kwargs["backend"] == "numpy"
    options = server_options(build_parser().parse_args([]), kwargs, None)
    assert options["model_name"] == kwargs["model"] and options["aliases"] == [kwargs["model"]]


def test_replica_flags_become_serve_options_and_bad_ones_are_refused():
    """--max-replicas turns on Serve's autoscaler between the bounds, starting at the size; a
    host backend's replicas split the RAM; bad bounds, and a replica flag where it would do
    nothing (one engine, or no autoscaler), are one line."""
    from engine.config import make_config
    from engine.distributed.replicas import engine_deployment_options, replica_engine_kwargs
    from engine.entrypoints.engine_args import engine_kwargs
    from engine.entrypoints.serve import build_parser, check_replica_args

    argv = "--data-parallel-size 2 --min-replicas 1 --max-replicas 4 --router round-robin"
    args = build_parser().parse_args(argv.split())
    config = make_config(data_parallel_size=2, backend="numpy")
    options = engine_deployment_options(args, config, 2)
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {
        "min_replicas": 1, "initial_replicas": 2, "max_replicas": 4, "target_ongoing_requests": 16.0
    }  # fmt: skip
    assert options["request_router_config"].request_router_kwargs["policy"] == "round-robin"
    kwargs = replica_engine_kwargs({"backend": "numpy", "data_parallel_size": 2}, 2, 10 << 30)
    assert kwargs["data_parallel_size"] == 1 and kwargs["memory_budget_bytes"] == int(
        0.45 * (10 << 30)
    )
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
    ]:
        args = build_parser().parse_args(argv.split())
        n = make_config(**engine_kwargs(args)).data_parallel_size
        with pytest.raises(ValueError, match=message):
            check_replica_args(args, n)
