"""``EngineConfig`` fields <-> command-line flags, in one place (vLLM's ``EngineArgs`` idea).

``add_engine_args(parser)`` adds one flag per field (``block_size`` -> ``--block-size``) with the
help text and choices kept beside the field in engine/config/__init__.py;
``engine_kwargs(args)`` turns the parsed flags back into keyword arguments for ``LLMEngine`` /
``LLM`` / ``make_config``, holding only the flags given (or defaulted by the CLI), so every other
field keeps EngineConfig's default.
``check_engine_args(args)`` checks what can be checked before the model loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

from engine.config import EngineConfig, make_config
from engine.devices import device as devices
from model_loader.load import INSTEAD, REPO_ID, SMOLLM2_ALIAS, resolve_model

FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
_TYPES = typing.get_type_hints(EngineConfig)


def flag_name(name: str) -> str:
    """``block_size`` -> ``--block-size``."""
    return "--" + name.replace("_", "-")


def add_engine_args(
    parser: argparse.ArgumentParser,
    defaults: dict | None = None,
    required: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
) -> argparse.ArgumentParser:
    """One flag per EngineConfig field except ``exclude``. ``defaults`` overrides a field's
    default for this CLI; ``required`` fields must be given."""
    defaults = defaults or {}
    unknown = sorted((set(defaults) | set(required) | set(exclude)) - set(FIELDS))
    if unknown:
        raise ValueError(f"add_engine_args: {unknown[0]!r} is not an EngineConfig field")
    group = parser.add_argument_group("engine", "EngineConfig fields (engine/config/__init__.py)")
    names = tuple(name for name in FIELDS if name not in exclude)
    for name in names:
        _add_flag(group, FIELDS[name], defaults.get(name), name in required)
    parser.set_defaults(engine_fields=names)  # which parsed values engine_kwargs reads
    return parser


def _add_flag(group, f: dataclasses.Field, default, required: bool) -> None:
    meta, kind = f.metadata, _arg_type(_TYPES[f.name])
    shown = f.default if default is None else default
    help_ = meta["help"] if required else f"{meta['help']} (default: {_describe(f, shown)})"
    kw = dict(dest=f.name, help=help_, default=default, required=required)
    if kind is bool:
        group.add_argument(flag_name(f.name), action="store_true", **kw)
    else:
        group.add_argument(flag_name(f.name), type=kind, choices=meta["choices"], **kw)


def _arg_type(hint) -> type:
    """``int | None`` -> int; a plain type stays itself."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _describe(f: dataclasses.Field, default) -> str:
    if default is None or default == "":
        return f.metadata["default_help"]
    return "on" if default is True else "off" if default is False else str(default)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields given on the command line (or defaulted by the CLI)."""
    given = {name: getattr(args, name) for name in args.engine_fields}
    return {name: value for name, value in given.items() if value is not None}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The checked EngineConfig of the parsed flags (a bad value is a ValueError naming it)."""
    return make_config(**engine_kwargs(args))


def check_engine_args(args: argparse.Namespace) -> EngineConfig:
    """The checked EngineConfig, once ``--model`` names something there and ``--backend cuda``
    has a GPU: everything a CLI checks before the model loads (a ValueError naming the flag)."""
    config = engine_config(args)
    check_model(config.model)
    check_backend(config.backend)
    return config


def check_model(model: str) -> None:
    """A local path must exist (and be an HF directory or a .gguf file); a Hub id or 'smollm2'
    is left to the loader, and '' is the default model."""
    if model in ("", SMOLLM2_ALIAS):
        return
    if Path(model).expanduser().exists():
        try:
            resolve_model(model)  # a local path resolves without reading the weights
        except ValueError as e:  # "model '...': directory has no config.json"
            raise ValueError(f"--{e}; {INSTEAD}") from None
    elif not REPO_ID.match(model) or model.startswith((".", "~")):
        raise ValueError(f"--model {model!r}: no such file or directory; {INSTEAD}")


def check_backend(backend: str) -> None:
    """``cuda`` needs a GPU that CuPy can see (``devices.gpu_status``)."""
    if backend != "cuda":
        return
    n, why = devices.gpu_status()
    if n == 0:
        raise ValueError(
            f"--backend cuda needs a GPU that CuPy can see and none was found ({why}); "
            "use --backend auto, numpy or cuda-cpu"
        )
