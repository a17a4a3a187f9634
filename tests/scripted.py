"""A model that writes a script: the tiny model's backend whose next token is the script's token
at that output position (the prompt's length given), then EOS. Server tests use it to make a
model write what a real one would (a reasoning model's <think>...</think>, say) and check what
the server makes of it; the grammar's masks still apply (a masked script token is not chosen)."""

from __future__ import annotations

import numpy as np

from engine.backends.forward_batch import ForwardBatch
from engine.backends.numpy_backend import NumpyBackend


class ScriptedBackend(NumpyBackend):
    """``script``: {"start": the prompt's length, "ids": the output's token ids}, set before
    the requests come (the same dict, changed between them)."""

    script: dict

    def _logits(self, batch: ForwardBatch) -> np.ndarray:
        rows = np.asarray(batch.output_rows)  # (R,) each output row's token row
        out = np.full((len(rows), self.cfg.vocab_size), -1e4, np.float32)  # (R, V)
        ids, start = self.script["ids"], self.script["start"]
        for r, pos in enumerate(np.asarray(batch.positions)[rows].tolist()):
            i = pos + 1 - start  # the output position this row's token goes to
            out[r, ids[i] if 0 <= i < len(ids) else self.script["eos"]] = 10.0
        return out


def scripted_factory(script: dict):
    """A backend_factory for LLMEngine: the NumpyBackend of the model, writing ``script``."""

    def make(model_config, weights, engine_config):
        backend = ScriptedBackend(model_config, weights, engine_config)
        backend.script = script
        return backend

    return make
