"""A live server for tests and scripts: uvicorn in a thread on 127.0.0.1 and an ephemeral port, over
an ``AsyncLLM`` on an already loaded model (a small fixed KV pool unless the engine arguments
say). ``LiveServer`` is a context manager; ``url`` ends in the port."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from engine.entrypoints.api_server import build_app
from engine.entrypoints.limits import ServerLimits
from engine.entrypoints.uvicorn_config import uvicorn_config
from engine.frontend.async_llm import AsyncLLM
from engine.frontend.llm_engine import LLMEngine

MODEL = "tiny"
SMALL_POOL = {"model": "test", "num_gpu_blocks": 64, "max_model_len": 256, "swap_space": 0.01}


class LiveServer:
    """``limits``: a ServerLimits (the app's and uvicorn's bounds); ``protect_metrics`` as for
    build_app; ``model_name``: the name it serves the model under; ``send_buffer``: each
    connection's socket send buffer in bytes (the kernel's own when None); the other keyword
    arguments are the engine's."""

    def __init__(
        self,
        loaded,
        api_key=None,
        max_waiting_requests=None,
        limits=None,
        protect_metrics=False,
        send_buffer=None,
        lora_modules=(),
        runtime_lora=False,
        tool_parser=None,
        reasoning_parser=None,
        web_ui=True,
        model_name=MODEL,
        chat_format=None,
        **engine_args,
    ):
        self.engine = LLMEngine(loaded=loaded, **{**SMALL_POOL, **engine_args})
        self.llm = AsyncLLM(self.engine, max_waiting_requests)
        limits = limits or ServerLimits()
        self.app = build_app(
            self.llm, model_name, api_key, (), limits, protect_metrics, lora_modules, runtime_lora,
            tool_parser=tool_parser, reasoning_parser=reasoning_parser, web_ui=web_ui,
            chat_format=chat_format,
        )  # fmt: skip
        # proto IPPROTO_TCP, as uvicorn's own sockets have: asyncio then sets TCP_NODELAY on
        # each connection (with proto 0 it does not, and every small answer waits 40 ms)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        if send_buffer:  # bytes; each connection inherits it, with the kernel's growth off
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn_config(self.app, limits, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, args=([self.sock],), daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 120  # a busy machine starts it slowly; an idle one in ms
        while not self.server.started:
            assert time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.01)
        return self

    def openai_client(self):
        """The openai package's client for this server, retries off."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.llm.shutdown()
        self.sock.close()
