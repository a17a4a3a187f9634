"""``python -m engine.serve``: the OpenAI-compatible server (FastAPI + uvicorn) over one engine.

    python -m engine.serve --model smollm2 --port 8000
    python -m engine.serve --model ./my-model --api-key secret --max-waiting-requests 64

SIGINT / SIGTERM / SIGHUP: the socket closes, running requests finish (up to --shutdown-timeout
seconds), then the engine thread stops and the process exits 0. Bad flags are one line, exit 2
(an empty --api-key or $PAGEDLLM_API_KEY among them: it must not switch authentication off).
"""

from __future__ import annotations

import logging
import signal
import sys

from engine.entrypoints.api_server import build_app
from engine.entrypoints.cli_utils import setup_logging
from engine.entrypoints.engine_args import check_engine_args, engine_kwargs
from engine.entrypoints.lora_routes import parse_lora_modules
from engine.entrypoints.serve_args import build_parser, check_replica_args, check_server_args
from engine.entrypoints.uvicorn_config import uvicorn_config
from engine.frontend.async_llm import AsyncLLM, LoggingStatLogger
from engine.frontend.llm_engine import LLMEngine

log = logging.getLogger("engine.serve")


def make_async_llm(args) -> tuple[AsyncLLM, str]:
    """The engine thread and the name it is served under."""
    engine = LLMEngine(**engine_kwargs(args))
    name = args.served_model_name or engine.config.model
    loggers = [LoggingStatLogger(args.log_stats_interval)]
    llm = AsyncLLM(engine, args.max_waiting_requests, loggers)
    return llm, name


def check_port_free(host: str, port: int) -> None:
    """A ValueError naming --port when something already listens there (0: any free one)."""
    import socket

    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(
                f"--port {port}: cannot listen on {host}:{port} ({e.strerror})"
            ) from None


def run(args) -> int:
    import uvicorn

    setup_logging(args.trace)
    limits = check_server_args(args)
    config = check_engine_args(args)  # bad engine values and --model fail before the model loads
    check_replica_args(args, config.data_parallel_size)
    check_port_free(args.host, args.port)  # before the model loads, not after
    if config.data_parallel_size > 1:
        return run_replicated(args, limits)
    llm, name = make_async_llm(args)
    aliases = [llm.engine.config.model]
    try:
        app = build_app(
            llm, name, args.api_key, aliases, limits, args.protect_metrics,
            parse_lora_modules(args.lora_modules), args.allow_runtime_lora_updating,
            tool_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
            web_ui=not args.disable_web_ui, chat_format=args.chat_format,
        )  # fmt: skip
    except ValueError as e:  # an adapter that does not fit: one line, as for any bad flag
        llm.shutdown()
        log.error("--lora-modules: %s", e)
        return 2
    config = uvicorn_config(
        app,
        limits,
        host=args.host,
        port=args.port,
        log_level="info",
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    server = uvicorn.Server(config)
    if not args.disable_web_ui and args.port:  # (port 0: uvicorn's line names the port it took)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        log.info("web page: http://%s:%d/ (chat, and the engine live)", host, args.port)
    # uvicorn re-raises the signal it stopped on once it is done; a clean stop exits 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stopped)
    signal.signal(signal.SIGHUP, lambda sig, frame: _hung_up(server))  # uvicorn ignores it
    try:
        server.run()  # returns after SIGINT/SIGTERM/SIGHUP and the grace period
    finally:
        llm.shutdown()
    log.info("server stopped")
    return 0


def run_replicated(args, limits) -> int:
    """The same API over --data-parallel-size engine replicas on Ray Serve
    (engine/entrypoints/replicas/deployment.py), until SIGINT/SIGTERM/SIGHUP, which drain them."""
    from engine.entrypoints.replicas.deployment import serve_replicas

    serve_replicas(args, engine_kwargs(args), limits)
    log.info("server stopped")
    return 0


def _stopped(signum, _frame) -> None:
    log.info("stopped by %s", signal.Signals(signum).name)


def _hung_up(server) -> None:
    """SIGHUP stops the server as SIGTERM does (a second one: at once)."""
    log.info("stopped by SIGHUP")
    server.force_exit = server.should_exit
    server.should_exit = True


def main(argv=None) -> int:
    return build_parser().run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
