"""Write tiny random checkpoints of several model families, saved by Hugging Face transformers 5,
plus golden logits and greedy tokens computed by transformers.

transformers and torch are NOT project dependencies: this script runs in a throwaway venv,

    python -m venv /tmp/golden-venv
    /tmp/golden-venv/bin/pip install torch==2.13.0 transformers safetensors numpy tokenizers
    /tmp/golden-venv/bin/python scripts/make_family_golden.py

(torch from PyPI's CPU index: ``--index-url https://download.pytorch.org/whl/cpu`` if the default
wheel pulls CUDA libraries you don't want.) No network access is needed: every config is built from
transformers' own config classes, never fetched from the Hub.

It writes, for each family in FAMILIES (Gemma 2 and 3's entries and variants are in
scripts/family_golden_gemma.py), a directory tests/data/families/<name>/ holding

    config.json, generation_config.json, model.safetensors   model.save_pretrained(), float32
    tokenizer.json, tokenizer_config.json                     model_loader/synthetic.py's tiny BPE
                                                              (train_tokenizer(320), ChatML)
    golden.json                                               see below

golden.json is {"meta": {...}, "cases": [...]}. Each case has a token-id prompt (ids 3..319 from a
seeded RNG, no tokenizer involved) of 5, 40 or 70 tokens; "token_ids": N_TOKENS greedy tokens from a
plain argmax loop that recomputes the whole sequence every step (no generate(), no KV cache, no EOS
stop); "logits": the float32 logits at the prompt's last position; "step_logits": the (N_TOKENS,
vocab) float32 logits that chose each token (row 0 = the prompt's last position); logits are base64
of little-endian float32. "min_margin" is the smallest top-1 minus top-2 gap over the steps
("min_margin_rel_std": the same, divided by that step's logits std).

After writing, the script checks that transformers loads the saved directory back to the same
logits, bit for bit, and that each family's quirk matters: VARIANTS (a wrong rope_theta, no llama3
scaling, the sliding window off or one wider, wrong layer_types, Gemma without its embedding scale
or its 1 + w norm, ...) must move the logits; the largest moves are recorded in meta["variants"].
`python scripts/make_family_golden.py llama gemma` regenerates only the families named.

Why the weights are re-randomised: transformers' default init (normal, std initializer_range=0.02)
gives almost uniform logits, so the greedy argmax is decided by float noise and another
implementation can't be expected to reproduce it. Every parameter is overwritten with seeded values
of a sensible scale instead: matrices N(0, 1/fan_in), the embedding N(0, 1), an untied lm_head x4,
RMSNorm weights 1 + 0.1 N(0, 1) (Gemma stores w and uses 1 + w, so there 0.1 N(0, 1)), Qwen3's
q_norm/k_norm 1 + 0.2 N(0, 1), biases 0.1 N(0, 1).

Tied-embedding families need two more changes. With lm_head = embed_tokens, the residual stream
always holds the current token's own embedding e_x, and e_x . e_x beats e_j . e_x for every other j,
so greedy decoding just repeats the prompt's last token whatever the layers compute. So in tied
families the residual branches' output projections (o_proj, down_proj) are scaled by
TIED_BRANCH_GAIN = 8, letting the layers, not the embedding, decide the next token (pre-norm layers
don't care about the residual stream's scale). Gemma multiplies the embedding by sqrt(hidden_size),
so its embedding is drawn N(0, 1/hidden_size): the scaled embedding is N(0, 1) like the others'.

A seed is accepted when every greedy step's top-1/top-2 gap is at least MARGIN_REL * std(logits)
and every case has at least MIN_DISTINCT distinct greedy tokens; otherwise the next seed is tried.
The seed used is recorded.

Everything is deterministic: running the script twice writes identical bytes (no date is stored).
"""

from __future__ import annotations

import base64
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from family_golden_moe import MOE_FAMILIES, MOE_VARIANTS  # noqa: E402  (scripts/)

from model_loader.synthetic import TINY_SHAPE, save_tokenizer, train_tokenizer  # noqa: E402  (numpy, tokenizers)
from scripts.family_golden_gemma import GEMMA_FAMILIES, GEMMA_MODELS, GEMMA_VARIANTS  # noqa: E402

OUT = ROOT / "tests" / "data" / "families"
VOCAB = TINY_SHAPE["vocab_size"]
N_TOKENS = 12
PROMPT_LENGTHS = (5, 40, 70)  # 40, 70 > the sliding windows (8-24) and llama3's original 32
PROMPT_SEED = 1234
MARGIN_REL = 1e-3  # every greedy step: top1 - top2 >= MARGIN_REL * std(logits)
MIN_DISTINCT = 5  # every case: at least this many distinct greedy tokens (not a fixed point)
TIED_BRANCH_GAIN = 8.0  # tied families: o_proj and down_proj x8 (see the module docstring)
ATTN = "eager"
BOS, EOS, PAD = 0, 0, 0  # <|endoftext|>; <|im_start|> = 1, <|im_end|> = 2

COMMON = dict(
    **TINY_SHAPE,
    num_hidden_layers=3,
    max_position_embeddings=256,
    bos_token_id=BOS,
    eos_token_id=EOS,
)


def rope(theta: float, **extra) -> dict:
    return {"rope_type": extra.pop("rope_type", "default"), "rope_theta": theta, **extra}


# name -> (config class, model class, config kwargs, first seed, notes)
FAMILIES = {
    "llama": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(rope_parameters=rope(50000.0), tie_word_embeddings=False),
        100,
        "rope_theta 50000 (not the 10000 default), untied lm_head",
    ),
    "llama3": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            rope_parameters=rope(
                500000.0,
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
            tie_word_embeddings=True,
            eos_token_id=[0, 2],
        ),
        200,
        "Llama-3 RoPE scaling (original context 32), tied embeddings, eos_token_id [0, 2]",
    ),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(rope_parameters=rope(1e6), tie_word_embeddings=True, use_sliding_window=False),
        300,
        "q/k/v biases, tied; use_sliding_window false, so Qwen2Config sets sliding_window to None",
    ),
    "qwen2_swa": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            rope_parameters=rope(1e6),
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        ),
        400,
        "sliding window 8 on layers i >= max_window_layers (1): layer_types decides per layer",
    ),
    "qwen2_yarn": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            rope_parameters=rope(
                10000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=64
            ),
            tie_word_embeddings=False,
            use_sliding_window=False,
        ),
        900,
        "YaRN RoPE scaling (factor 4, original context 64: cos and sin times 0.1 ln 4 + 1), "
        "as Qwen2.5 configures it for long contexts",
    ),
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(rope_parameters=rope(1e6), head_dim=32, tie_word_embeddings=True),
        500,
        "head_dim 32 != hidden/heads 16, per-head q_norm/k_norm RMSNorm before RoPE, tied",
    ),
    "mistral": (
        MistralConfig,
        MistralForCausalLM,
        dict(rope_parameters=rope(10000.0), sliding_window=8, head_dim=16),
        600,
        "sliding window 8 on every layer (mask kv > q - 8), untied",
    ),
    "phi3": (
        Phi3Config,
        Phi3ForCausalLM,
        dict(
            rope_parameters=rope(10000.0),
            sliding_window=12,
            original_max_position_embeddings=256,
            pad_token_id=PAD,
            tie_word_embeddings=False,
        ),
        700,
        "fused qkv_proj (q, k, v rows) and gate_up_proj (gate rows, then up rows); sliding "
        "window 12 on every layer (Phi3Model picks the sliding-window mask when "
        "config.sliding_window is set); no rope scaling",
    ),
    "gemma": (
        GemmaConfig,
        GemmaForCausalLM,
        dict(
            rope_parameters=rope(10000.0),
            head_dim=32,
            hidden_act="gelu_pytorch_tanh",
            pad_token_id=PAD,
            tie_word_embeddings=True,
        ),
        800,
        "head_dim 32, GeGLU with gelu_pytorch_tanh (config key hidden_act), RMSNorm uses (1 + w), "
        "embeddings scaled by sqrt(hidden_size) = 8 in float32, tied",
    ),
}
FAMILIES |= GEMMA_FAMILIES  # Gemma 2 and 3 (scripts/family_golden_gemma.py)


# name -> {description: (config overrides, model edit or None, smallest max |logit diff| allowed)}.
# Each variant is what a loader that misses the family's quirk would compute, applied to the saved
# checkpoint: its logits must differ from the golden ones by more than the bound (the largest
# difference is recorded in meta["variants"], so a test's tolerance can be set below it).
FAMILIES |= MOE_FAMILIES


def _gemma_no_embed_scale(model) -> None:
    model.model.embed_tokens.embed_scale.fill_(1.0)


def _gemma_norm_w_not_1_plus_w(model) -> None:
    for pname, p in model.named_parameters():
        if "norm" in pname:
            p.sub_(1.0)  # GemmaRMSNorm then multiplies by w, as a Llama-style norm would


VARIANTS = {
    "llama": {"rope_theta 10000": (dict(rope_parameters=rope(10000.0)), None, 0.1)},
    "llama3": {"no llama3 rope scaling": (dict(rope_parameters=rope(500000.0)), None, 0.1)},
    "qwen2": {"rope_theta 10000": (dict(rope_parameters=rope(10000.0)), None, 0.1)},
    "qwen2_swa": {
        "every layer full attention": (dict(layer_types=["full_attention"] * 3), None, 0.1),
        "every layer sliding": (dict(layer_types=["sliding_attention"] * 3), None, 0.1),
        "sliding_window 9": (dict(sliding_window=9), None, 0.1),
    },
    "qwen2_yarn": {"no yarn scaling": (dict(rope_parameters=rope(10000.0)), None, 0.1)},
    "qwen3": {"rope_theta 10000": (dict(rope_parameters=rope(10000.0)), None, 0.1)},
    "mistral": {
        "no sliding window": (dict(sliding_window=None), None, 0.1),
        "sliding_window 9": (dict(sliding_window=9), None, 0.1),
    },
    "phi3": {
        "no sliding window": (dict(sliding_window=None), None, 0.1),
        "sliding_window 13": (dict(sliding_window=13), None, 0.1),
    },
    "gemma": {
        "embeddings not scaled by sqrt(hidden)": ({}, _gemma_no_embed_scale, 0.1),
        "RMSNorm multiplies by w, not 1 + w": ({}, _gemma_norm_w_not_1_plus_w, 0.1),
        # small by nature: a float32 test needs a tolerance under this to tell erf from tanh gelu
        "exact (erf) gelu instead of gelu_pytorch_tanh": (dict(hidden_act="gelu"), None, 1e-4),
    },
}
VARIANTS |= GEMMA_VARIANTS


VARIANTS |= MOE_VARIANTS


def b64_float32(x: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(x, dtype="<f4").tobytes()).decode("ascii")


def build(name: str, seed: int):
    cfg_cls, model_cls, kw, _, _ = FAMILIES[name]
    config = cfg_cls(**{**COMMON, **kw})
    config._attn_implementation = ATTN
    model = model_cls(config).to(torch.float32).eval()
    assert model.config._attn_implementation == ATTN
    randomise(model, name, np.random.default_rng(seed))
    return model


@torch.no_grad()
def randomise(model, family: str, rng: np.random.Generator) -> None:
    """Overwrite every parameter (named_parameters order, tied ones once) with seeded values."""
    cfg = model.config
    tied = cfg.tie_word_embeddings
    gain = TIED_BRANCH_GAIN if tied else 1.0
    for pname, p in model.named_parameters():
        shape = tuple(p.shape)
        z = rng.standard_normal(shape)
        if pname.endswith("embed_tokens.weight"):
            w = z / np.sqrt(cfg.hidden_size) if family.startswith("gemma") else z
        elif pname == "lm_head.weight":
            w = 4.0 * z / np.sqrt(shape[1])
        elif pname.endswith("bias"):
            w = 0.1 * z
        elif "norm" in pname:
            if family.startswith("gemma"):
                w = 0.1 * z  # GemmaRMSNorm multiplies by (1 + weight)
            elif pname.endswith(("q_norm.weight", "k_norm.weight")):
                w = 1.0 + 0.2 * z
            else:
                w = 1.0 + 0.1 * z
        elif pname.endswith("sinks"):  # gpt-oss: one sink logit per head
            w = z
        elif family == "gpt_oss" and len(shape) == 3:  # its experts are (E, in, out)
            w = z / np.sqrt(shape[1])
        else:
            assert len(shape) in (2, 3), pname  # 3: a mixture's experts, (E, out, in)
            w = z / np.sqrt(shape[-1])
            if pname.endswith(("o_proj.weight", "down_proj.weight")):
                w = gain * w
        p.copy_(torch.from_numpy(w.astype(np.float32)))


@torch.no_grad()
def greedy(model, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """N_TOKENS argmax tokens, full recompute each step, no cache, no EOS stop; and their logits."""
    ids = torch.tensor([prompt], dtype=torch.long)  # (1, T)
    tokens, rows = [], []
    for _ in range(N_TOKENS):
        logits = model(input_ids=ids, use_cache=False).logits[0, -1].to(torch.float32)  # (V,)
        nxt = int(torch.argmax(logits))
        tokens.append(nxt)
        rows.append(logits.numpy().copy())
        ids = torch.cat([ids, torch.tensor([[nxt]], dtype=torch.long)], dim=1)
    return tokens, np.stack(rows)  # (N_TOKENS, V)


def margins(step_logits: np.ndarray) -> tuple[float, float]:
    """Smallest top1 - top2 gap, absolute and relative to each step's logits std."""
    top2 = np.sort(step_logits, axis=-1)[:, -2:]
    gap = top2[:, 1] - top2[:, 0]
    rel = gap / step_logits.std(axis=-1)
    return float(gap.min()), float(rel.min())


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(PROMPT_SEED)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]


def make_cases(model) -> tuple[list[dict], float]:
    cases, worst_rel = [], np.inf
    for prompt in prompts():
        tokens, step_logits = greedy(model, prompt)
        gap, rel = margins(step_logits)
        worst_rel = min(worst_rel, rel)
        cases.append(
            {
                "prompt_token_ids": prompt,
                "token_ids": tokens,
                "logits": b64_float32(step_logits[0]),
                "step_logits": b64_float32(step_logits),
                "min_margin": gap,
                "min_margin_rel_std": rel,
            }
        )
    return cases, worst_rel


def write_tokenizer(path: Path) -> None:
    """The same files model_loader/synthetic.py writes: tokenizer.json and tokenizer_config.json."""
    tok = train_tokenizer(VOCAB)
    assert tok.get_vocab_size() <= VOCAB
    specials = [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert specials == [0, 1, 2], specials
    save_tokenizer(path, tok)


def structure(model) -> dict:
    """What transformers 5 actually does with this config, recorded for the loader's tests."""
    cfg = model.config
    info = {"attn_implementation": cfg._attn_implementation}
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        info["layer_types"] = list(cfg.layer_types)
    info["sliding_window"] = getattr(cfg, "sliding_window", None)
    if info["sliding_window"] is not None:
        info["sliding_window_mask"] = (
            "transformers masking_utils.sliding_window_overlay: query i sees keys j with "
            "i - sliding_window < j <= i (the window counts the query itself)"
        )
    return info


def init_note(model) -> str:
    note = (
        "all parameters re-randomised from 'seed' (numpy default_rng, named_parameters order): "
        "matrices N(0, 1/fan_in), embedding N(0, 1), biases 0.1 N(0, 1), RMSNorm 1 + 0.1 N(0, 1)"
    )
    if isinstance(model, Qwen3ForCausalLM):
        note += ", q_norm/k_norm 1 + 0.2 N(0, 1)"
    if isinstance(model, GemmaForCausalLM | GEMMA_MODELS):
        note += "; Gemma: RMSNorm weights 0.1 N(0, 1) (used as 1 + w), embedding N(0, 1/hidden)"
    if model.config.tie_word_embeddings:
        note += f"; tied: o_proj and down_proj x{TIED_BRANCH_GAIN:g}"
    else:
        note += "; untied lm_head x4"
    return note


def make_family(name: str) -> None:
    _, _, _, seed, notes = FAMILIES[name]
    for attempt in range(50):
        model = build(name, seed + attempt)
        cases, worst_rel = make_cases(model)
        distinct = min(len(set(c["token_ids"])) for c in cases)
        if worst_rel >= MARGIN_REL and distinct >= MIN_DISTINCT:
            seed += attempt
            break
        print(
            f"  {name}: seed {seed + attempt} rejected (margin {worst_rel:.2e} * std, "
            f"{distinct} distinct tokens), next seed"
        )
    else:
        raise RuntimeError(f"{name}: no seed with a clear, non-degenerate greedy decoding")

    path = OUT / name
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    meta = {
        "family": name,
        "architecture": type(model).__name__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seed": seed,
        "prompt_seed": PROMPT_SEED,
        "dtype": "float32",
        "init": init_note(model),
        "decoding": "greedy argmax, full recompute (no KV cache), no EOS stop",
        "n_tokens": N_TOKENS,
        "logits": "base64 of little-endian float32: 'logits' (vocab,) at the prompt's last "
        "position; 'step_logits' (n_tokens, vocab), row i chose token_ids[i]",
        **structure(model),
        "notes": notes,
    }
    check_reload(path, cases)
    meta["variants"] = check_variants(name, path, cases)
    golden = {"meta": meta, "cases": cases}
    (path / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    size = sum(f.stat().st_size for f in path.iterdir())
    gaps = ", ".join(f"{c['min_margin']:.3g}" for c in cases)
    print(f"wrote {path.relative_to(ROOT)} ({size / 1e3:.0f} kB) seed {seed} min margins {gaps}")


@torch.no_grad()
def check_reload(path: Path, cases: list[dict]) -> None:
    """The saved checkpoint, loaded back by transformers, gives the same first logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=ATTN
    ).eval()
    for c in cases:
        got = model(input_ids=torch.tensor([c["prompt_token_ids"]]), use_cache=False).logits[0, -1]
        want = np.frombuffer(base64.b64decode(c["logits"]), dtype="<f4")
        np.testing.assert_array_equal(got.numpy(), want)


@torch.no_grad()
def check_variants(name: str, path: Path, cases: list[dict]) -> dict:
    """Max |logit difference| over all cases and steps between each variant and the golden data."""
    out = {}
    for desc, (overrides, edit, bound) in VARIANTS.get(name, {}).items():
        config = transformers.AutoConfig.from_pretrained(path)
        for k, v in overrides.items():
            setattr(config, k, v)  # after __post_init__: Gemma's "gelu" -> tanh rewrite is bypassed
        config._attn_implementation = ATTN
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=torch.float32
        ).eval()
        if edit is not None:
            edit(model)
        worst = 0.0
        for c in cases:
            prompt = c["prompt_token_ids"]
            ids = torch.tensor([prompt + c["token_ids"][:-1]])  # teacher-forced golden tokens
            got = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 :].numpy()
            want = np.frombuffer(base64.b64decode(c["step_logits"]), dtype="<f4").reshape(got.shape)
            worst = max(worst, float(np.abs(got - want).max()))
        assert worst > bound, f"{name}: variant {desc!r} is indistinguishable ({worst:.2e})"
        out[desc] = {"max_abs_logit_diff": float(f"{worst:.3g}")}
    return out


def main() -> None:
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # the same reduction order every run
    only = sys.argv[1:] or list(FAMILIES)
    for name in only:
        make_family(name)


if __name__ == "__main__":
    main()
