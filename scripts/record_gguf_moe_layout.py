"""Record what llama.cpp's converter writes for the tiny mixture-of-experts checkpoints:
tests/data/gguf_moe_layout.json, the list tests/test_gguf_moe.py holds its own GGUF writer to.

Runs at development time only, in the golden venv (transformers, torch, gguf, sentencepiece)
with a llama.cpp checkout (LLAMA_CPP_DIR, default the vendored one of llama-cpp-python 0.3.36):

    /tmp/golden-venv/bin/python scripts/record_gguf_moe_layout.py

For each family it converts (convert_hf_to_gguf.py, --outtype f32 and q8_0) a checkpoint of
tests/data/families/<name>; llama.cpp's Qwen2-MoE and Qwen3-MoE converters map no dense MLP
inside a mixture, so for those two a copy with every layer sparse is built first (the same
config and seed as scripts/family_golden_moe.py, mlp_only_layers []). The converter's BPE
pre-tokenizer check does not know the tiny test tokenizer: it is answered "gpt-2" (the
tokenizer is not what is recorded). Recorded per family and outtype: general.architecture,
every ``<arch>.*`` metadata key with its value, and the global tensors' and layer 0's names,
GGUF dims (fastest first) and types.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP = Path(
    os.environ.get("LLAMA_CPP_DIR", "/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp")
)
OUT = ROOT / "tests" / "data" / "gguf_moe_layout.json"
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss")
ALL_SPARSE = ("qwen3_moe", "qwen2_moe")  # golden checkpoints with a dense layer


def convert_main() -> None:
    """convert_hf_to_gguf.py's main, the pre-tokenizer check answered (argv: its own)."""
    sys.path[:0] = [str(LLAMA_CPP), str(LLAMA_CPP / "gguf-py")]
    import conversion.base as base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
    runpy.run_path(str(LLAMA_CPP / "convert_hf_to_gguf.py"), run_name="__main__")


def all_sparse_copy(name: str, out: Path) -> Path:
    """The family's golden checkpoint with every layer sparse (the same seed)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_family_golden as mfg

    cfg_cls, model_cls, kw, seed, notes = mfg.FAMILIES[name]
    mfg.FAMILIES[name] = (cfg_cls, model_cls, {**kw, "mlp_only_layers": []}, seed, notes)
    model = mfg.build(name, seed)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(mfg.OUT / name / f, out / f)
    return out


def layout(path: Path) -> dict:
    import gguf  # here: the converter's process imports llama.cpp's own gguf-py first

    r = gguf.GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    meta = {k: f.contents() for k, f in r.fields.items() if k.startswith(arch + ".")}
    tensors = {
        t.name: [[int(n) for n in t.shape], t.tensor_type.name]
        for t in r.tensors
        if not t.name.startswith("blk.") or t.name.startswith("blk.0.")
    }
    return {"architecture": arch, "metadata": meta, "tensors": tensors}


def main() -> None:
    record = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in FAMILIES:
            src = ROOT / "tests" / "data" / "families" / name
            if name in ALL_SPARSE:
                src = all_sparse_copy(name, Path(tmp) / name)
            for outtype in ("f32", "q8_0"):
                path = Path(tmp) / f"{name}-{outtype}.gguf"
                cmd = [sys.executable, __file__, "--convert", str(src), "--outtype", outtype]
                subprocess.run([*cmd, "--outfile", str(path)], check=True, capture_output=True)
                record.setdefault(name, {})[outtype] = layout(path)
    OUT.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    convert_main() if sys.argv[1:2] == ["--convert"] else main()
