"""Model files -> a ``LoadedModel`` (config, weights, tokenizer), for the reference and the engine.

load.py        ``load_model(name or path)``: a Hugging Face directory, a GGUF file, the bundled
               SmolLM2; ``default_model``, ``resolve_model``
config.py      ``ModelConfig``: the architecture's numbers, from config.json or GGUF metadata
families.py    what differs between the model families (norms, biases, rope, windows)
rope.py        rotary embedding tables and their scalings
hf_weights.py  safetensors checkpoints -> ``ModelWeights``, converted tensor by tensor
gguf_file.py   GGUF files: metadata, tensors (block formats kept or dequantized), tokenizer
weights.py     ``ModelWeights``: the per-layer arrays every backend packs its own way
tokenizer.py   the tokenizer of either kind of file
synthetic.py   tiny random checkpoints in Hugging Face layout (tests, benchmarks)
"""
