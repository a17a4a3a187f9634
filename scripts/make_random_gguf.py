"""Random models as F16 GGUF files in llama.cpp's layouts, with the bundled SmolLM2's tokenizer
(so 49,152 token ids), for benchmarks against llama.cpp: quantize them with its
``llama-quantize`` (Q8_0, Q4_K_M) or ``python -m engine.tools.quantize``. Weights are normal with
std 0.02 (norms 1), so the logits are flat: for speed, not text.

Shapes (``--shape``):
  qwen3moe   a Qwen3-MoE of about 1.5B parameters, 0.25B active per token: 24 layers, hidden
             1024, 16 query and 4 K/V heads of 64, 64 experts of width 256, top 8 (no shared
             expert, every layer sparse)
  qwen3dense its dense twin of the same active size: the same attention, an MLP of 2048 (its 8
             experts of 256), 0.31B parameters
  gemma3     Gemma-3-1B's layers: 26 of them, hidden 1152, 4 query heads and 1 K/V head of 256,
             MLP 6912, sliding window 512 on five layers of six, QK-norm, sandwich norms (its
             262,144-token vocabulary is SmolLM2's 49,152 here)
  gpt-oss    gpt-oss-20b's layers, 8 of its 24: hidden 2880, 64 query and 8 K/V heads of 64
             with biases and sinks, window 128 on every other layer, experts of width 2880,
             top 4 of 8 (the 20b has 32: a token reads 4 either way), router and expert biases
             (llama-quantize's MXFP4_MOE makes the experts MXFP4, as the released files)

    python scripts/make_random_gguf.py --shape gemma3 /tmp/gemma3-f16.gguf
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


class Writer:
    def __init__(self, path: str, arch: str, seed: int):
        self.w, self.rng = gguf.GGUFWriter(path, arch), np.random.default_rng(seed)
        self.vocab = tokenizer_keys(self.w, str(smollm2_path()))

    def sizes(self, layers, ctx, d, f, heads, kv, hd, theta, eps) -> None:
        """The keys every shape writes: its sizes, RoPE base, norm epsilon, the F16 file type."""
        w = self.w
        w.add_block_count(layers), w.add_context_length(ctx), w.add_embedding_length(d)
        w.add_feed_forward_length(f), w.add_head_count(heads), w.add_head_count_kv(kv)
        w.add_key_length(hd), w.add_value_length(hd), w.add_rope_freq_base(theta)
        w.add_layer_norm_rms_eps(eps), w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    def normal(self, name: str, *shape, dtype=F16) -> None:
        self.w.add_tensor(name, (self.rng.standard_normal(shape, np.float32) * 0.02).astype(dtype))

    def ones(self, name: str, n: int) -> None:
        self.w.add_tensor(name, np.ones(n, np.float32))

    def attention(self, b: str, d: int, heads: int, kv: int, hd: int) -> None:
        self.ones(b + "attn_norm.weight", d)
        self.normal(b + "attn_q.weight", heads * hd, d)
        self.normal(b + "attn_k.weight", kv * hd, d)
        self.normal(b + "attn_v.weight", kv * hd, d)
        self.normal(b + "attn_output.weight", d, heads * hd)
        self.ones(b + "attn_q_norm.weight", hd)
        self.ones(b + "attn_k_norm.weight", hd)

    def finish(self, d: int) -> None:
        self.ones("output_norm.weight", d)
        self.normal("output.weight", self.vocab, d)
        self.w.write_header_to_file(), self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()


def qwen3moe(path: str, seed: int) -> None:
    layers, d, heads, kv, hd, e, f, k = 24, 1024, 16, 4, 64, 64, 256, 8
    out = Writer(path, "qwen3moe", seed)
    out.sizes(layers, 4096, d, f, heads, kv, hd, 1e6, 1e-6)
    w = out.w
    w.add_expert_count(e), w.add_expert_used_count(k), w.add_expert_feed_forward_length(f)
    out.normal("token_embd.weight", out.vocab, d)
    for i in range(layers):
        b = f"blk.{i}."
        out.attention(b, d, heads, kv, hd)
        out.ones(b + "ffn_norm.weight", d)
        out.normal(b + "ffn_gate_inp.weight", e, d, dtype=np.float32)
        out.normal(b + "ffn_gate_exps.weight", e, f, d)
        out.normal(b + "ffn_up_exps.weight", e, f, d)
        out.normal(b + "ffn_down_exps.weight", e, d, f)
    out.finish(d)


def qwen3dense(path: str, seed: int) -> None:
    """The qwen3moe shape's dense twin: its attention, and one MLP of the 8 x 256 units a token
    of the mixture runs (the same active parameters per token)."""
    layers, d, heads, kv, hd, f = 24, 1024, 16, 4, 64, 2048
    out = Writer(path, "qwen3", seed)
    out.sizes(layers, 4096, d, f, heads, kv, hd, 1e6, 1e-6)
    out.normal("token_embd.weight", out.vocab, d)
    for i in range(layers):
        b = f"blk.{i}."
        out.attention(b, d, heads, kv, hd)
        out.ones(b + "ffn_norm.weight", d)
        out.normal(b + "ffn_gate.weight", f, d)
        out.normal(b + "ffn_up.weight", f, d)
        out.normal(b + "ffn_down.weight", d, f)
    out.finish(d)


def gemma3(path: str, seed: int) -> None:
    layers, d, heads, kv, hd, f = 26, 1152, 4, 1, 256, 6912
    out = Writer(path, "gemma3", seed)
    out.sizes(layers, 32768, d, f, heads, kv, hd, 1e6, 1e-6)
    out.w.add_float32("gemma3.rope.freq_base_swa", 10000.0)
    out.w.add_sliding_window(512)
    out.normal("token_embd.weight", out.vocab, d)
    for i in range(layers):
        b = f"blk.{i}."
        out.attention(b, d, heads, kv, hd)
        for n in ("post_attention_norm", "ffn_norm", "post_ffw_norm"):
            out.ones(b + n + ".weight", d)
        out.normal(b + "ffn_gate.weight", f, d)
        out.normal(b + "ffn_up.weight", f, d)
        out.normal(b + "ffn_down.weight", d, f)
    out.finish(d)


def gpt_oss(path: str, seed: int) -> None:
    layers, d, heads, kv, hd, e, f, k = 8, 2880, 64, 8, 64, 8, 2880, 4
    out = Writer(path, "gpt-oss", seed)
    out.sizes(layers, 131072, d, f, heads, kv, hd, 150000.0, 1e-5)
    w = out.w
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN), w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_expert_count(e), w.add_expert_used_count(k), w.add_expert_feed_forward_length(f)
    w.add_sliding_window(128)
    out.normal("token_embd.weight", out.vocab, d)
    for i in range(layers):
        b = f"blk.{i}."
        out.ones(b + "attn_norm.weight", d)
        for name, rows in (("attn_q", heads * hd), ("attn_k", kv * hd), ("attn_v", kv * hd)):
            out.normal(b + name + ".weight", rows, d)
            out.normal(b + name + ".bias", rows, dtype=np.float32)
        out.normal(b + "attn_output.weight", d, heads * hd)
        out.normal(b + "attn_output.bias", d, dtype=np.float32)
        out.normal(b + "attn_sinks.weight", heads, dtype=np.float32)
        out.ones(b + "post_attention_norm.weight", d)
        out.normal(b + "ffn_gate_inp.weight", e, d, dtype=np.float32)
        out.normal(b + "ffn_gate_inp.bias", e, dtype=np.float32)
        for name, shape in (("ffn_gate_exps", (e, f, d)), ("ffn_up_exps", (e, f, d))):
            out.normal(b + name + ".weight", *shape)
            out.normal(b + name + ".bias", e, f, dtype=np.float32)
        out.normal(b + "ffn_down_exps.weight", e, d, f)
        out.normal(b + "ffn_down_exps.bias", e, d, dtype=np.float32)
    out.finish(d)


SHAPES = {"qwen3moe": qwen3moe, "qwen3dense": qwen3dense, "gemma3": gemma3, "gpt-oss": gpt_oss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the .gguf file to write")
    ap.add_argument("--shape", choices=SHAPES, default="qwen3moe", help="the model (qwen3moe)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (0)")
    a = ap.parse_args()
    start = time.perf_counter()
    SHAPES[a.shape](a.out, a.seed)
    print(f"wrote {a.out} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
