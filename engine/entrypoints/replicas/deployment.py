"""Data parallel: ``data_parallel_size`` replicas of the engine behind one OpenAI endpoint, on Ray
Serve (``python -m engine.serve --data-parallel-size N``).

    HTTP -> Serve's proxy -> Ingress (the same FastAPI app as one engine's: engine/entrypoints)
              tokenize, check, SamplingParams     ReplicatedLLM.add_requests
              -> the engine deployment's handle: PolicyRequestRouter picks a replica
                 (routing.py: round-robin, least-loaded or prefix-aware)
              -> EngineReplica (one AsyncLLM each: its engine core, its executor's ranks)
              <- a stream of RequestOutputs
              detokenized text, stop strings: already in each RequestOutput

The ingress loads the tokenizer and config only (no weights). A replica's first message for a
request says it was queued (or raises the refusal: a 400 or 503 as on one engine); a request
whose replica dies before that goes to another; one whose replica dies after it ends with an
error, never silently short. Serve restarts a dead replica (``check_health`` fails when its
engine thread has died). ``/metrics`` gathers every replica's metrics, each with an ``engine``
label, and adds the router's counters; ``/health`` answers 200 while some replica answers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

from engine.backends import resolve_backend_name
from engine.backends.cpu_native import THREADS_ENV
from engine.config import make_config
from engine.entrypoints.lora_routes import parse_lora_modules
from engine.entrypoints.replicas.metrics import MergedMetrics, MetricsBoard
from engine.frontend.async_llm import AsyncLLM, EngineDeadError
from engine.frontend.input_processor import FrontendState
from model_loader.load import default_model, load_model

log = logging.getLogger("engine.replicas")
ACCEPTED = "accepted"  # a replica's first message: the request is queued
RETRIES = 3  # times a request whose replica died before queueing it is sent again
PUBLISH_S = 0.5  # seconds between a replica's metrics updates on the board


def _replica_name() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


class EngineReplica:
    """One replica of the engine deployment: an AsyncLLM over its own LLMEngine."""

    def __init__(self, engine_kwargs: dict, model_name: str, max_waiting: int | None):
        from engine.entrypoints.prometheus import PrometheusStatLogger
        from engine.frontend.llm_engine import LLMEngine

        self.name, self.board = _replica_name(), metrics_board()
        self.metrics = PrometheusStatLogger(model_name, engine=self.name)
        engine = LLMEngine(**engine_kwargs)
        self.llm = AsyncLLM(engine, max_waiting, [self.metrics])
        self._stop = threading.Event()
        threading.Thread(target=self._publish, name="metrics-board", daemon=True).start()
        # Serve's logger: a replica's own loggers have no handler; this one reaches the driver
        logging.getLogger("ray.serve").info(
            "engine replica %s ready (pid %d)", self.name, os.getpid()
        )

    def _publish(self) -> None:
        """The replica's metrics to the board every PUBLISH_S seconds, while it lives."""
        while not self._stop.is_set():
            text = self.metrics.render().decode()
            self.board.put.remote(self.name, text, self.llm.num_unfinished)
            self._stop.wait(PUBLISH_S)

    async def generate(self, request: dict):
        """ACCEPTED once queued (a refusal raises), then each RequestOutput of the request."""
        ids, params, rid = request["prompt_token_ids"], request["params"], request["request_id"]
        final_only, lora = request.get("final_only", False), request.get("lora_request")
        stream = await self.llm.add_request(ids, params, rid, final_only, lora_request=lora)
        yield ACCEPTED
        async for out in stream:  # leaving early (the caller cancelled) aborts the request
            yield out

    def ping(self) -> str:
        return self.name

    async def check_health(self) -> None:
        """Serve's periodic check: a dead engine thread fails it, and Serve restarts us."""
        await self.llm.check_health()

    def __del__(self):
        if hasattr(self, "_stop"):
            self._stop.set()
            self.llm.shutdown()


class FrontendView(FrontendState):
    """What the server reads of an engine, for an ingress that holds no engine: the config,
    the tokenizer, the prompt bounds, the model's sampling defaults, a structured-output
    compiler (a constraint that compiles here compiles in the replicas)."""

    def __init__(self, engine_kwargs: dict):
        config = make_config(**engine_kwargs)
        self.init_frontend(config, load_model(config.model, weights=False))
        self._compiler = None

    def structured_compiler(self):
        """Built on first use (half a second for a 49k vocabulary), then kept with its cache."""
        from engine.core.sequence import model_eos_ids
        from engine.core.structured import model_compiler

        if self._compiler is None:
            self._compiler = model_compiler(self.loaded, model_eos_ids(self.loaded))
        return self._compiler


class RemoteStream:
    """One request's outputs from its replica, as ``async_llm.RequestStream`` gives them."""

    def __init__(self, request_id: str, response, first):
        self.request_id, self._response, self.finished = request_id, response, False
        self._iter = first

    def abort(self) -> None:
        if not self.finished:
            self._response.cancel()

    async def __aiter__(self):
        try:
            async for out in self._iter:
                self.finished = out.finished
                yield out
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the replica died or failed mid-request
            raise EngineDeadError(f"the engine replica serving this request failed: {e}") from e
        finally:
            self.abort()


class ReplicatedLLM:
    """``AsyncLLM``'s interface to the server, over the engine deployment's replicas."""

    def __init__(self, handle, view: FrontendView, model_name: str):
        self.handle, self.engine, self.tokenizer = handle, view, view.tokenizer
        self.board = metrics_board()
        self._draining, self._asked = False, 0.0  # the board's drain flag, asked each 0.5 s
        self.model_name = model_name
        self.stat_loggers: list = []  # the server's own logger sees no steps here: unused

    async def add_requests(
        self,
        prompts: list,
        params=None,
        request_ids=None,
        final_only: bool = False,
        lora_request=None,
    ) -> list:
        """Route each prompt to a replica; all queued, or none (the first refusal raises).
        ``final_only``, ``lora_request``: as AsyncLLM's."""
        import uuid

        if await self._is_draining():
            raise EngineDeadError("the server is shutting down: it takes no new requests")
        rids = request_ids or [uuid.uuid4().hex for _ in prompts]
        streams: list[RemoteStream] = []
        try:
            for rid, ids in zip(rids, prompts, strict=True):
                streams.append(await self._start(rid, ids, params, final_only, lora_request))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    async def _start(
        self, rid: str, ids, params, final_only: bool = False, lora=None
    ) -> RemoteStream:
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        request = {"prompt_token_ids": list(ids), "params": params, "request_id": rid}
        request["final_only"] = final_only
        if lora is not None:  # routed by adapter too: its chunks named after the adapter's id
            request["lora_request"] = lora
            request["route_ids"] = [-lora.lora_int_id, *ids]
        for attempt in range(RETRIES + 1):
            response = self.handle.options(stream=True).generate.remote(request)
            it = response.__aiter__()
            try:
                first = await it.__anext__()
            except (ActorDiedError, ActorUnavailableError) as e:  # not queued: another replica
                if attempt == RETRIES:
                    raise EngineDeadError(f"no engine replica took the request: {e}") from None
                log.warning("replica died before queueing %s; routing it again", rid)
                continue
            assert first == ACCEPTED, first
            return RemoteStream(rid, response, it)
        raise AssertionError("unreachable")

    async def _is_draining(self) -> bool:
        if not self._draining and time.monotonic() - self._asked > PUBLISH_S:
            self._asked = time.monotonic()
            self._draining = await self.board.is_draining.remote()
        return self._draining

    async def check_health(self) -> None:
        """Healthy while some replica answers within 5 s."""
        try:
            await asyncio.wait_for(self.handle.ping.remote(), 5.0)
        except Exception as e:  # noqa: BLE001 - no live replica, or none in time
            raise EngineDeadError(f"no engine replica answers: {type(e).__name__}: {e}") from None

    async def render_metrics(self) -> bytes:
        """Every replica's metrics (one per replica, each with its ``engine`` label) and the
        router's counters, in Prometheus text."""
        from prometheus_client import CollectorRegistry, generate_latest

        texts, routed = await self.board.snapshot.remote()
        registry = CollectorRegistry()
        registry.register(MergedMetrics(texts, routed, self.model_name))
        return generate_latest(registry)


class Ingress:
    """The ingress deployment: the server's FastAPI app over a ReplicatedLLM (built on the
    replica, by Serve's ``__serve_build_asgi_app__``)."""

    def __init__(self, engine_handle, engine_kwargs: dict, server: dict):
        view = FrontendView(engine_kwargs)
        self.llm = ReplicatedLLM(engine_handle, view, server["model_name"])
        self.server = server

    def __serve_build_asgi_app__(self):
        from engine.entrypoints.api_server import build_app

        o = self.server
        return build_app(
            self.llm, o["model_name"], o["api_key"], o["aliases"], o["limits"], o["protect"],
            o.get("lora_modules", ()), o.get("runtime_lora", False),
            tool_parser=o.get("tool_parser"), reasoning_parser=o.get("reasoning_parser"),
            web_ui=o.get("web_ui", True), chat_format=o.get("chat_format"),
        )  # fmt: skip


def most_replicas(args, n: int) -> int:
    """The most replicas there may be: --max-replicas under autoscaling, else the size."""
    return args.max_replicas or n


def replica_engine_kwargs(kwargs: dict, n: int, ram: int, backend: str) -> dict:
    """One replica's engine arguments: one replica of its own, in the cluster already joined;
    on a host backend each of the ``n`` replicas there may be gets 1/n of 0.9 x the RAM for its
    memory plan, unless the pool is sized by hand (``num_gpu_blocks`` or
    ``memory_budget_bytes``). ``backend``: the one ``auto`` resolves to here."""
    out = dict(kwargs, data_parallel_size=1, ray_address=None)
    by_hand = kwargs.get("num_gpu_blocks") or kwargs.get("memory_budget_bytes")
    if backend != "cuda" and not by_hand:
        out["memory_budget_bytes"] = int(0.9 * ram / n)
    return out


def engine_deployment_options(args, config, n: int, backend: str) -> dict:
    """Serve's options for the engine deployment: replicas (or autoscaling), resources, the
    router, health checks, the drain on shutdown. On the host, each of the replicas there may
    be reserves its share of the cores, and a ``cpu`` replica runs that many kernel threads
    (each would take every core otherwise). ``backend``: the one ``auto`` resolves to here."""
    from ray.serve.config import RequestRouterConfig

    from engine.entrypoints.serve_args import autoscaling_keys

    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    # GPUs for the replica's own ranks (mp or uni); the ray executor reserves its own bundles
    gpus = ranks if backend == "cuda" and config.distributed_executor_backend != "ray" else 0
    cpus = max(1, (os.cpu_count() or 1) // most_replicas(args, n)) if ranks == 1 else 1
    actor = {"num_cpus": cpus, "num_gpus": gpus}
    if backend == "cpu":
        actor["runtime_env"] = {"env_vars": {THREADS_ENV: str(cpus)}}
    options = dict(
        name="engine",
        max_ongoing_requests=max(4 * config.max_num_seqs, 64),  # the engine queues the rest
        ray_actor_options=actor,
        request_router_config=RequestRouterConfig(
            request_router_class="engine.entrypoints.replicas.router:PolicyRequestRouter",
            request_router_kwargs={"policy": args.router, "imbalance": args.router_imbalance},
        ),
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=args.shutdown_timeout,
    )
    if args.max_replicas is not None:
        extra = autoscaling_keys(args.autoscaling_config) if args.autoscaling_config else {}
        options["autoscaling_config"] = {
            "min_replicas": args.min_replicas,
            "initial_replicas": n,
            "max_replicas": args.max_replicas,
            "target_ongoing_requests": args.target_ongoing_requests,
            **extra,
        }
    else:
        options["num_replicas"] = n
    return options


def metrics_board():
    """The metrics board of this cluster's app: made by the first that asks, found by the rest
    (detached: a Serve config deployed from a short-lived process outlives it)."""
    import ray

    from engine.entrypoints.replicas.router import BOARD

    actor = ray.remote(MetricsBoard).options(
        name=BOARD, namespace="serve", lifetime="detached", get_if_exists=True, num_cpus=0
    )
    return actor.remote()


def build_application(args, kwargs: dict, server: dict):
    """The Serve application: the ingress over ``data_parallel_size`` engine replicas."""
    from ray import serve

    from engine.core.memory import available_ram_bytes

    config = make_config(**kwargs)
    n = config.data_parallel_size
    most, backend = most_replicas(args, n), resolve_backend_name(config.backend)
    replica_kwargs = replica_engine_kwargs(kwargs, most, available_ram_bytes(), backend)
    options = engine_deployment_options(args, config, n, backend)
    engine = serve.deployment(EngineReplica).options(**options)
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name="ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000
    )
    bound = engine.bind(replica_kwargs, server["model_name"], args.max_waiting_requests)
    return ingress.bind(bound, replica_kwargs, server)


def app(config: dict):
    """For a Serve config file (``import_path: engine.entrypoints.replicas.deployment:app``):
    ``args`` are the server's flags, as names without the dashes (``data_parallel_size: 2``); the
    cluster is the one ``serve deploy`` talks to."""
    from engine.entrypoints.engine_args import engine_kwargs
    from engine.entrypoints.serve_args import build_parser, check_replica_args, check_server_args

    argv = []
    for key, value in config.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [] if value is False else [flag, str(value)]
    args = build_parser().parse_args(argv)
    limits = check_server_args(args)
    kwargs = with_model(engine_kwargs(args))
    check_replica_args(args, make_config(**kwargs).data_parallel_size)
    return build_application(args, kwargs, server_options(args, kwargs, limits))


def with_model(kwargs: dict) -> dict:
    """The engine arguments with the model named: the default model is chosen here, once, so
    the ingress and every replica load the same one."""
    if kwargs.get("model"):
        return kwargs
    name, why = default_model()
    log.info("model: %s (%s)", name, why)
    return dict(kwargs, model=name)


def server_options(args, kwargs: dict, limits) -> dict:
    """What the ingress's app needs of the server's flags."""
    name = args.served_model_name or kwargs["model"]
    return dict(
        model_name=name,
        api_key=args.api_key,
        aliases=[kwargs["model"]],
        limits=limits,
        protect=args.protect_metrics,
        lora_modules=parse_lora_modules(getattr(args, "lora_modules", None)),
        runtime_lora=getattr(args, "allow_runtime_lora_updating", False),
        web_ui=not getattr(args, "disable_web_ui", False),
        tool_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        chat_format=getattr(args, "chat_format", None),
    )


def serve_replicas(args, kwargs: dict, limits) -> None:
    """Run the Serve application until SIGINT, SIGTERM or SIGHUP, then drain it."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ValueError(
            f"--data-parallel-size needs Ray Serve (pip install 'ray[serve]'): {e}"
        ) from None

    kwargs = with_model(kwargs)
    config = make_config(**kwargs)
    n = config.data_parallel_size
    if not ray.is_initialized():
        address = config.ray_address or os.environ.get("RAY_ADDRESS")
        cpus = None if address else max(os.cpu_count() or 1, most_replicas(args, n))
        ray.init(address=address, num_cpus=cpus, include_dashboard=False, log_to_driver=True)
    stop = _stop_on_signals()  # after ray.init, which installs handlers of its own
    serve.start(http_options={"host": args.host, "port": args.port})
    server = server_options(args, kwargs, limits)
    board = metrics_board()
    serve.run(build_application(args, kwargs, server), name="pagedllm", route_prefix="/")
    log.info(
        "serving %s on http://%s:%d with %d engine replicas, router %s",
        server["model_name"],
        args.host,
        args.port,
        n,
        args.router,
    )
    try:
        stop.wait()
    finally:
        drain(board, args.shutdown_timeout)
        serve.shutdown()
        ray.kill(board)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def stopped(signum, _frame):
        log.info("stopped by %s", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stopped)
    return stop


def drain(board, timeout: float) -> None:
    """No new requests; the running ones get up to ``timeout`` seconds to finish (and their
    last bytes a moment to reach the client) before Serve is shut down."""
    import ray

    log.info("draining the replicas (up to %g s)", timeout)
    ray.get(board.drain.remote())
    deadline = time.monotonic() + timeout
    time.sleep(2 * PUBLISH_S)  # the replicas' counts on the board are current
    while time.monotonic() < deadline and ray.get(board.unfinished.remote()):
        time.sleep(0.2)
    time.sleep(min(1.0, max(deadline - time.monotonic(), 0)))
