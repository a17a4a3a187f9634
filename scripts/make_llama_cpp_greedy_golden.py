"""llama.cpp's own greedy tokens for tiny checkpoints of tests/data/families, as GGUF files its
converter wrote (float32, and Q8_0 by its llama-quantize where named):
tests/data/families/llama_cpp_greedy.json (development time only).

The families: Gemma 2 and Gemma 3, Mixtral and gpt-oss (the tiny Qwen2-MoE and Qwen3-MoE have dense
layers among their sparse ones, and the tiny OLMoE grouped K/V heads with a whole-vector K norm:
llama.cpp runs neither).

Needs llama.cpp's source (``--llama-cpp``: the ``vendor/llama.cpp`` of PyPI's llama-cpp-python
sdist), its built ``llama-simple`` (``--bin``) and a Python with the converter's requirements
(torch, transformers, gguf) to run this script. The tiny checkpoints' tokenizers are unknown
to the converter, so it is told to take them as a plain BPE vocabulary ("default"
pre-tokenizer); the tensors and hyperparameters are converted by its own code. llama-simple
samples greedily and prints the prompt's ids and each new id on stderr.

    python scripts/make_llama_cpp_greedy_golden.py --llama-cpp /tmp/lcp/.../vendor/llama.cpp \\
        --bin /tmp/lcp/.../build/bin
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

FAMILY_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "families"
OUT = FAMILY_DIR / "llama_cpp_greedy.json"
FILES = {"gemma2": ("f32",), "gemma3": ("f32",), "mixtral": ("f32", "q8_0")}
FILES["gpt_oss"] = ("f32", "mxfp4_moe")  # MXFP4_MOE: the experts MXFP4, the rest as they are
PROMPT = "the quick brown fox jumps over the lazy dog and then some more words follow here"
NEW_TOKENS = 24

CONVERT = """
import runpy, sys
sys.path.insert(0, {src!r})
import conversion.base as base
import conversion.gemma as gemma
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
base.TextModel._set_vocab_sentencepiece = lambda self, *a, **k: self._set_vocab_gpt2()
base.TextModel._set_vocab_llama_hf = lambda self, *a, **k: self._set_vocab_gpt2()
gemma.Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outtype", "f32", "--outfile", {out!r}]
runpy.run_path({src!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(src: str, model: Path, out: Path) -> None:
    code = CONVERT.format(src=src, model=str(model), out=str(out))
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def quantize(bin_dir: str, src: Path, out: Path, qtype: str) -> None:
    env = {**os.environ, "LD_LIBRARY_PATH": bin_dir}
    cmd = [f"{bin_dir}/llama-quantize", str(src), str(out), qtype.upper()]
    subprocess.run(cmd, env=env, check=True, capture_output=True)


def greedy(bin_dir: str, gguf: Path) -> tuple[list[int], list[int]]:
    """(the prompt's ids, llama.cpp's greedy ids) from llama-simple's stderr."""
    env = {**os.environ, "LD_LIBRARY_PATH": bin_dir}
    cmd = [f"{bin_dir}/llama-simple", "-m", str(gguf), "-n", str(NEW_TOKENS), PROMPT]
    err = subprocess.run(cmd, env=env, check=True, capture_output=True).stderr.decode(
        errors="replace"
    )
    prompt = [int(x) for x in re.findall(r"\[prompt (\d+)\]", err)]
    ids = [int(x) for x in re.findall(r"\[id (\d+)\]", err)]
    return prompt, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp's source tree (converter)")
    ap.add_argument("--bin", required=True, help="the folder of the built llama-simple")
    ap.add_argument("names", nargs="*", help="only these families (the others' cases kept)")
    args = ap.parse_args()
    golden = {"llama_cpp": "llama-cpp-python 0.3.36's vendor/llama.cpp", "cases": {}}
    if args.names and OUT.exists():
        golden["cases"] = json.loads(OUT.read_text())["cases"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, types in FILES.items():
            if args.names and name not in args.names:
                continue
            golden["cases"][name] = {}
            path = Path(tmp) / f"{name}.gguf"
            convert(args.llama_cpp, FAMILY_DIR / name, path)
            for qtype in types:
                if qtype != "f32":
                    quantized = Path(tmp) / f"{name}-{qtype}.gguf"
                    quantize(args.bin, path, quantized, qtype)
                prompt, ids = greedy(args.bin, path if qtype == "f32" else quantized)
                case = {"prompt_token_ids": prompt, "token_ids": ids}
                golden["cases"].setdefault(name, {})[qtype] = case
                print(f"{name} {qtype}: {len(prompt)} prompt ids, {ids[:8]} ...")
    OUT.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
