"""Golden data from Hugging Face transformers, shipped with the package (scripts/make_golden.py).

``smollm2.json``: SmolLM2-135M-Instruct; ``tiny.json``: the tests' tiny random model. Each case:
prompt text (and chat messages), prompt token ids, 32 greedy token ids, their text, and the
float32 logits at the prompt's last position (base64). ``engine.diff`` and the tests read them here.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np

GOLDEN_DIR = Path(__file__).resolve().parent
LOGITS_ATOL = 1e-3  # transformers vs us, float32, first-step logits


def golden_path(name: str) -> Path:
    """The file of a golden set: ``golden_path("smollm2")`` -> .../engine/golden/smollm2.json."""
    return GOLDEN_DIR / f"{name}.json"


def read_golden(name: str) -> dict:
    """A golden set by name ("smollm2", "tiny"): {"cases": [...], "tokenizer_cases": [...]}."""
    return json.loads(golden_path(name).read_text())


def golden_logits(case: dict) -> np.ndarray:
    """A golden case's last-prompt-position logits, (V,) float32 (stored as base64)."""
    return np.frombuffer(base64.b64decode(case["last_logits_f32_b64"]), dtype="<f4")
