"""``python -m engine.serve``'s flags and their checks, read by the server and by the Ray Serve
replicas' application builder alike (engine/entrypoints/replicas/deployment.py): the server's
own flags, the data-parallel ones (router, autoscaling), the limits and the engine's.
"""

from __future__ import annotations

import json
import os

from engine.entrypoints.cli_utils import CliParser
from engine.entrypoints.engine_args import add_engine_args
from engine.entrypoints.limits import ServerLimits, add_limit_args, limits_from_args
from engine.entrypoints.lora_routes import parse_lora_modules
from engine.entrypoints.middleware import check_api_key
from engine.entrypoints.reasoning import PARSERS as REASONING_PARSERS
from engine.entrypoints.replicas.routing import POLICIES
from engine.entrypoints.tool_parsers import PARSERS

API_KEY_ENV = "PAGEDLLM_API_KEY"


def build_parser() -> CliParser:
    p = CliParser(prog="python -m engine.serve", description="Serve the OpenAI API over HTTP.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind; 0 = any free one")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        f"(default: ${API_KEY_ENV}, else none; an empty key is refused)",
    )
    p.add_argument(
        "--protect-metrics",
        action="store_true",
        help="with --api-key, /metrics needs the key too (default: /metrics is open)",
    )
    p.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        help="sequences that may wait beyond the free run slots; a request that would make "
        "more wait answers 503 with Retry-After; 0: only what can run now (default: no bound)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGINT/SIGTERM (default 30)",
    )
    p.add_argument(
        "--log-stats-interval",
        type=float,
        default=5.0,
        help="seconds between throughput log lines while requests run (default 5)",
    )
    p.add_argument("--trace", action="store_true", help="log the life of every request")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served as models of their own: a request whose "
        "model is NAME runs with the adapter at PATH (needs --enable-lora)",
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter, vLLM's routes that "
        "serve and stop serving adapters while the server runs",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        help="the format tool_choice auto reads the model's tool calls in (vLLM's names; "
        "default: the one the chat template writes, hermes when it shows none)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="split a reasoning model's <think>...</think> (openai_gptoss: harmony's analysis "
        "channel) from its answer: reasoning_content "
        "in chat completions, a reasoning item in responses, a thinking block in messages; "
        "structured output and forced tool calls apply to the answer (vLLM's names)",
    )
    p.add_argument(
        "--chat-format",
        choices=("harmony", "template"),
        help="how chat prompts are written and outputs read: harmony (OpenAI's format, with "
        "the openai_gptoss and openai parsers) or the model's chat template (default: harmony "
        "for a gpt_oss model, else the template)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's switch for tool_choice auto; accepted: auto is always on here",
    )
    p.add_argument(
        "--disable-web-ui",
        action="store_true",
        help="leave out the web page at / (chat and the engine's live view), its files under "
        "/web/ and GET /v1/engine/events (all 404)",
    )
    add_replica_args(p)
    add_limit_args(p)
    return add_engine_args(p)


REPLICA_DEFAULTS = {"router": "prefix-aware", "router_imbalance": 4, "min_replicas": 1}
REPLICA_DEFAULTS |= {"max_replicas": None, "target_ongoing_requests": 16.0}
REPLICA_DEFAULTS |= {"autoscaling_config": None}
# Serve's autoscaling keys that have flags of their own (or follow from --data-parallel-size)
FLAGGED_KEYS = {"min_replicas": "--min-replicas", "max_replicas": "--max-replicas"}
FLAGGED_KEYS |= {"initial_replicas": "--data-parallel-size"}
FLAGGED_KEYS |= {"target_ongoing_requests": "--target-ongoing-requests"}


def add_replica_args(p) -> None:
    g = p.add_argument_group(
        "data parallel (with --data-parallel-size above 1: engine replicas on Ray Serve)"
    )
    g.add_argument(
        "--router",
        choices=POLICIES,
        default=REPLICA_DEFAULTS["router"],
        help="how a request's replica is chosen: prefix-aware (the replica that was sent the "
        "longest prefix of its prompt, unless the replicas' queues differ by more than "
        "--router-imbalance, then the least loaded), least-loaded, or round-robin "
        "(default prefix-aware)",
    )
    g.add_argument(
        "--router-imbalance",
        type=int,
        default=REPLICA_DEFAULTS["router_imbalance"],
        help="queued requests by which replicas may differ before prefix-aware routing sends "
        "to the least loaded instead (default 4)",
    )
    g.add_argument(
        "--min-replicas",
        type=int,
        default=REPLICA_DEFAULTS["min_replicas"],
        help="with --max-replicas: autoscaling's lower bound (default 1)",
    )
    g.add_argument(
        "--max-replicas",
        type=int,
        help="autoscale between --min-replicas and this, starting at --data-parallel-size "
        "(default: a fixed --data-parallel-size replicas)",
    )
    g.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=REPLICA_DEFAULTS["target_ongoing_requests"],
        help="autoscaling: requests in flight per replica that Serve aims for (default 16)",
    )
    g.add_argument(
        "--autoscaling-config",
        metavar="JSON",
        help="with --max-replicas: more of Ray Serve's autoscaling_config keys as a JSON "
        'object, e.g. \'{"upscale_delay_s": 5, "downscale_delay_s": 120}\' (Serve\'s defaults '
        "otherwise: scale up after 30 s of load, down after 600 s)",
    )


def check_server_args(args) -> ServerLimits:
    """The server's own flags, checked before the model loads; returns the limits."""
    parse_lora_modules(args.lora_modules)  # a ValueError names a bad item
    if (args.lora_modules or args.allow_runtime_lora_updating) and not args.enable_lora:
        flag = "--lora-modules" if args.lora_modules else "--allow-runtime-lora-updating"
        raise ValueError(f"{flag} needs --enable-lora")
    if args.api_key is not None:
        try:
            check_api_key(args.api_key)
        except ValueError as e:
            from_env = args.api_key == os.environ.get(API_KEY_ENV)
            where = f"--api-key (here from ${API_KEY_ENV})" if from_env else "--api-key"
            raise ValueError(f"{where}: {e}") from None
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    return limits_from_args(args)


def check_replica_args(args, n: int) -> None:
    """The data-parallel flags: each given only where it acts (one engine has no router, no
    autoscaler), and in its range."""
    if args.max_replicas is not None and n == 1:
        raise ValueError("--max-replicas (autoscaling) needs --data-parallel-size above 1")
    for name, default in REPLICA_DEFAULTS.items():
        flag, given = "--" + name.replace("_", "-"), getattr(args, name) != default
        if n == 1 and given:
            raise ValueError(f"{flag} needs --data-parallel-size above 1 (one engine, no replicas)")
        needs_max = ("min_replicas", "target_ongoing_requests", "autoscaling_config")
        if name in needs_max and given and not args.max_replicas:
            raise ValueError(f"{flag} needs --max-replicas (autoscaling)")
    if args.router_imbalance < 0:
        raise ValueError(f"--router-imbalance must be >= 0, got {args.router_imbalance}")
    if args.max_replicas is not None:
        if not 1 <= args.min_replicas <= n <= args.max_replicas:
            raise ValueError(
                f"autoscaling needs 1 <= --min-replicas ({args.min_replicas}) <= "
                f"--data-parallel-size ({n}) <= --max-replicas ({args.max_replicas})"
            )
    if args.target_ongoing_requests <= 0:
        raise ValueError("--target-ongoing-requests must be > 0")
    if args.autoscaling_config is not None:
        autoscaling_keys(args.autoscaling_config)


def autoscaling_keys(text: str) -> dict:
    """--autoscaling-config's JSON object, each key one that Ray Serve's AutoscalingConfig has
    (Serve accepts unknown keys silently) and no flag of ours sets; values checked by Serve."""
    what = "--autoscaling-config"
    try:
        keys = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not JSON: {e}") from None
    if not isinstance(keys, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(keys).__name__}")
    for key in keys:
        if key in FLAGGED_KEYS:
            raise ValueError(f"{what}: {key!r} is set by {FLAGGED_KEYS[key]}, not here")
    try:
        from ray.serve.config import AutoscalingConfig
    except ImportError:  # checked again where Serve is imported
        return keys
    unknown = sorted(set(keys) - set(AutoscalingConfig.model_fields))
    if unknown:
        raise ValueError(f"{what}: Ray Serve's autoscaling_config has no key {unknown[0]!r}")
    try:
        AutoscalingConfig(min_replicas=1, max_replicas=2, **keys)
    except ValueError as e:  # pydantic's ValidationError: the first error, on one line
        err = e.errors()[0] if hasattr(e, "errors") else {"loc": ("?",), "msg": str(e)}
        raise ValueError(f"{what}: {err['loc'][0]}: {err['msg']}") from None
    return keys
