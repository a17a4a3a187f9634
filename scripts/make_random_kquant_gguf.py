"""A Qwen3-30B-A3B-shaped random model written straight as a Q4_K_M GGUF: random Q4_K and Q6_K
blocks, streamed to disk one tensor at a time, for the speed and memory of a file larger than
this machine's RAM could hold as float16 (its float16 source would be 61 GB; llama-quantize
needs one). The tensors get llama-quantize's Q4_K_M types (model_loader/kquant_mix.py; the
router stays float32, as llama-quantize leaves it). Each block's bytes are random and its
scales fixed so that the values have a standard deviation near 0.02: for speed, not text.

Shape: 48 layers, hidden 2048, 32 query and 4 K/V heads of 128 with QK-norm, 128 experts of
width 768, top 8, every layer sparse (Qwen3-30B-A3B's), with the bundled SmolLM2's tokenizer
(49,152 token ids against the real model's 151,936: its embedding and LM head are a third of
the real ones'). About 30B parameters, 3.2B read per token; 17 GB.

    python scripts/make_random_kquant_gguf.py /tmp/qwen3-30b-a3b-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import gguf
import numpy as np
from make_random_gguf import tokenizer_keys

from model_loader.kquant_mix import FILE_TYPE, tensor_types
from model_loader.load import smollm2_path

Q = gguf.GGMLQuantizationType
BYTES = {"Q4_K": 144, "Q6_K": 210}  # a super-block of 256 values


@dataclasses.dataclass(frozen=True)
class Shape:
    """Qwen3-30B-A3B's sizes (row lengths must be multiples of 256)."""

    layers: int = 48
    d: int = 2048  # hidden
    heads: int = 32
    kv: int = 4
    hd: int = 128  # head dim
    experts: int = 128
    f: int = 768  # an expert's width
    top_k: int = 8


def shapes(s: Shape, vocab: int) -> dict[str, tuple[int, ...]]:
    """{name: NumPy shape} of every tensor, llama.cpp's names."""
    d, q, kv, e, f = s.d, s.heads * s.hd, s.kv * s.hd, s.experts, s.f
    out = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,), "output.weight": (vocab, d)}
    for i in range(s.layers):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": (d,), b + "attn_q.weight": (q, d)}
        out |= {b + "attn_k.weight": (kv, d), b + "attn_v.weight": (kv, d)}
        out |= {b + "attn_output.weight": (d, q), b + "attn_q_norm.weight": (s.hd,)}
        out |= {b + "attn_k_norm.weight": (s.hd,), b + "ffn_norm.weight": (d,)}
        out |= {b + "ffn_gate_inp.weight": (e, d), b + "ffn_gate_exps.weight": (e, f, d)}
        out |= {b + "ffn_up_exps.weight": (e, f, d), b + "ffn_down_exps.weight": (e, d, f)}
    return out


def blocks(rng: np.random.Generator, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random super-blocks of a tensor: (*shape[:-1], shape[-1] / 256 * bytes) uint8. Q4_K
    values are d sc q - dmin m (sc, m, q random): d 9e-5, dmin 7.5 d centre them; Q6_K values
    are d sc (q - 32) with int8 sc: d 1.5e-5."""
    n = int(np.prod(shape[:-1])) * (shape[-1] // 256)
    raw = np.frombuffer(rng.bytes(n * BYTES[type_name]), np.uint8).reshape(n, -1).copy()
    if type_name == "Q4_K":
        raw[:, 0:4] = np.array([9e-5, 6.75e-4], np.float16).view(np.uint8)
    else:
        raw[:, 208:210] = np.array([1.5e-5], np.float16).view(np.uint8)
    return raw.reshape(*shape[:-1], -1)


def tensor(rng, name: str, shape, type_name: str | None) -> tuple[np.ndarray, object]:
    """(the tensor's bytes or values, its GGUF type or None for a NumPy dtype's)."""
    if type_name is None:
        if name.endswith("norm.weight"):
            return np.ones(shape, np.float32), None
        return (rng.standard_normal(shape, np.float32) * 0.02), None  # the router
    return blocks(rng, type_name, shape), Q[type_name]


def write(path: str, seed: int, s: Shape = Shape()) -> None:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "qwen3moe")
    vocab = tokenizer_keys(w, str(smollm2_path()))
    w.add_block_count(s.layers), w.add_context_length(40960), w.add_embedding_length(s.d)
    w.add_feed_forward_length(6144), w.add_head_count(s.heads), w.add_head_count_kv(s.kv)
    w.add_key_length(s.hd), w.add_value_length(s.hd), w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6), w.add_file_type(FILE_TYPE["q4_k_m"])
    w.add_expert_count(s.experts), w.add_expert_used_count(s.top_k)
    w.add_expert_feed_forward_length(s.f)
    sizes = shapes(s, vocab)
    types = tensor_types(sizes, "q4_k_m", s.layers)
    types |= {n: None for n in sizes if "ffn_gate_inp" in n}  # llama-quantize keeps the router
    order = list(types)  # file order
    for name in order:
        s, t = sizes[name], types[name]
        if t is None:
            w.add_tensor_info(name, s, np.dtype(np.float32), 4 * int(np.prod(s)))
        else:
            byte_shape = (*s[:-1], s[-1] // 256 * BYTES[t])
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), Q[t])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_ti_data_to_file()
    done, start = 0, time.perf_counter()
    for i, name in enumerate(order):
        data, _ = tensor(rng, name, sizes[name], types[name])
        w.write_tensor_data(data)
        done += data.nbytes
        last = i == len(order) - 1
        if name.endswith("ffn_down_exps.weight") or last:
            gb, secs = done / 1e9, time.perf_counter() - start
            what = "every tensor" if last else name.split(".ffn")[0]
            print(f"  {what}: {gb:.1f} GB written ({secs:.0f} s)", file=sys.stderr)
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the .gguf file to write (about 17 GB)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (0)")
    a = ap.parse_args()
    start = time.perf_counter()
    write(a.out, a.seed)
    print(f"wrote {a.out} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
