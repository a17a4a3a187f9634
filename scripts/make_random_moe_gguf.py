"""A random Qwen3-MoE-shaped model as an F16 GGUF in llama.cpp's layout (qwen3moe: stacked
``ffn_*_exps`` experts, F32 routers and norms), with the bundled SmolLM2's tokenizer, for
benchmarks against llama.cpp: quantize it with its ``llama-quantize`` (Q8_0, Q4_K_M) or
``python -m engine.tools.quantize``.

The default shape is about 1.5B parameters with 0.25B active per token: 24 layers, hidden 1024,
16 query and 4 K/V heads of 64, 64 experts of width 256, top 8 (no shared expert, every layer
sparse). Weights are normal with std 0.02 (norms 1), so logits are flat: for speed, not text.

    python scripts/make_random_moe_gguf.py /tmp/moe-f16.gguf
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np

from model_loader.load import smollm2_path

F16 = np.float16


def tokenizer_keys(w: gguf.GGUFWriter, src: str) -> int:
    """Copy the tokenizer.* keys of a GGUF file; -> its vocabulary size."""
    r = gguf.GGUFReader(src)
    for field in r.fields.values():
        if field.name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(field.name, field.contents(), vtype, sub)
    return len(r.fields["tokenizer.ggml.tokens"].contents())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the .gguf file to write")
    ap.add_argument("--layers", type=int, default=24, help="decoder layers (24)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (1024)")
    ap.add_argument("--experts", type=int, default=64, help="experts per layer (64)")
    ap.add_argument("--top-k", type=int, default=8, help="experts per token (8)")
    ap.add_argument("--expert-width", type=int, default=256, help="an expert's width (256)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (0)")
    a = ap.parse_args()
    rng, d, f, e, hd = np.random.default_rng(a.seed), a.hidden, a.expert_width, a.experts, 64
    heads, kv = d // hd, max(1, d // hd // 4)
    w = gguf.GGUFWriter(a.out, "qwen3moe")
    vocab = tokenizer_keys(w, str(smollm2_path()))
    w.add_block_count(a.layers), w.add_context_length(4096), w.add_embedding_length(d)
    w.add_feed_forward_length(f), w.add_head_count(heads), w.add_head_count_kv(kv)
    w.add_key_length(hd), w.add_value_length(hd), w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6), w.add_expert_count(e), w.add_expert_used_count(a.top_k)
    w.add_expert_feed_forward_length(f), w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    def normal(*shape, dtype=F16):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(dtype)

    ones = np.ones(d, np.float32)
    w.add_tensor("token_embd.weight", normal(vocab, d))
    for i in range(a.layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", ones)
        w.add_tensor(b + "attn_q.weight", normal(heads * hd, d))
        w.add_tensor(b + "attn_k.weight", normal(kv * hd, d))
        w.add_tensor(b + "attn_v.weight", normal(kv * hd, d))
        w.add_tensor(b + "attn_output.weight", normal(d, heads * hd))
        w.add_tensor(b + "attn_q_norm.weight", np.ones(hd, np.float32))
        w.add_tensor(b + "attn_k_norm.weight", np.ones(hd, np.float32))
        w.add_tensor(b + "ffn_norm.weight", ones)
        w.add_tensor(b + "ffn_gate_inp.weight", normal(e, d, dtype=np.float32))
        w.add_tensor(b + "ffn_gate_exps.weight", normal(e, f, d))
        w.add_tensor(b + "ffn_up_exps.weight", normal(e, f, d))
        w.add_tensor(b + "ffn_down_exps.weight", normal(e, d, f))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", normal(vocab, d))
    start = time.perf_counter()
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    print(f"wrote {a.out} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
