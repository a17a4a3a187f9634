"""The README's server examples as written: its serve command's flags (parsed by the server's
own parser) on SmolLM2, and its Anthropic snippet run against that server, printing a sensible
answer. Only the address and the served model's name are swapped for the test server's."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

from engine.entrypoints.engine_args import engine_kwargs
from engine.entrypoints.serve_args import build_parser
from engine.tools.live_server import MODEL, LiveServer

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def serve_flags() -> dict:
    """The engine keywords the README's first serve command sets (beside --model/--port)."""
    line = re.search(r"^\.venv/bin/python -m engine\.serve --model smollm2 --port 8000(.*)$",
                     README, re.M)  # fmt: skip
    assert line, "the README's serve command is gone"
    parser = build_parser()
    args = parser.parse_args(shlex.split(line.group(1)))
    plain = vars(parser.parse_args([]))
    return {k: v for k, v in engine_kwargs(args).items() if v != plain.get(k)}


def python_block(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    found = [b for b in blocks if marker in b]
    assert found, f"no python block with {marker!r} in the README"
    return found[0]


def test_the_anthropic_example_answers(smollm2):
    flags = serve_flags()
    assert "override_generation_config" in flags, flags
    code = python_block("anthropic.Anthropic(")
    with LiveServer(smollm2, backend="cpu", max_model_len=512, **flags) as s:
        code = code.replace("http://127.0.0.1:8000", s.url).replace('"smollm2"', repr(MODEL))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {})
    assert "Paris" in out.getvalue() and "end_turn" in out.getvalue(), out.getvalue()
