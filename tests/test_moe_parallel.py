"""Mixtures of experts on several ranks: tensor parallel cuts each expert's units (gate and up
rows, down columns; Qwen2-MoE's shared expert likewise) and all-reduces the layer's output, every
rank routing every token with the whole router; pipeline parallel gives each stage its layers
(dense and sparse ones). Against transformers' golden tokens and logits, in worker processes."""

from __future__ import annotations

import numpy as np
import pytest

from engine.executor.sharding import Shard, Stage
from tests.test_families import check_outputs, engine_outputs, loaded


@pytest.mark.parametrize(
    "name, tp, pp, backend",
    [
        ("qwen2_moe", 2, 1, "numpy"),
        ("mixtral", 2, 1, "numpy"),
        ("qwen3_moe", 1, 2, "numpy"),
        ("gpt_oss", 2, 1, "numpy"),
        ("gpt_oss", 1, 2, "numpy"),
        ("qwen2_moe", 2, 1, "cuda-cpu"),  # the emulated NCCL's all-reduce after the experts
        ("gpt_oss", 2, 1, "cuda-cpu"),
    ],
)
def test_ranks_give_transformers_tokens(name, tp, pp, backend):
    cases, outs = engine_outputs(
        name, backend, tensor_parallel_size=tp, pipeline_parallel_size=pp,
        distributed_executor_backend="mp",
    )  # fmt: skip
    check_outputs(name, cases, outs)


def test_olmoe_is_refused_on_tensor_parallel_ranks():
    """Its q and k norms are over every head's values: a rank's heads alone would norm wrong."""
    with pytest.raises(ValueError, match="olmoe's q and k norms span every head at once"):
        engine_outputs("olmoe", "numpy", tensor_parallel_size=2, distributed_executor_backend="mp")


def test_a_ranks_experts_are_its_units_of_each_expert():
    m = loaded("qwen2_moe")
    cfg, w = m.config, m.weights
    f, fs = cfg.moe.intermediate_size, cfg.moe.shared_intermediate_size
    layer = next(i for i, lw in enumerate(w.layers) if lw.router is not None)
    lw = w.layers[layer]
    gates, downs, shared = [], [], []
    for rank in range(2):
        s = Shard.of(cfg, rank, 2)
        local, part = s.config(cfg), s.weights(w, cfg).layers[layer]
        assert local.moe.intermediate_size + local.moe.shared_intermediate_size == len(
            s.expert_ffn
        ) + len(s.shared_ffn)
        np.testing.assert_array_equal(part.router, lw.router)  # whole on every rank
        np.testing.assert_array_equal(part.s_logit, lw.s_logit)
        gates.append(part.e_gate), downs.append(part.e_down), shared.append(part.s_down)
    np.testing.assert_array_equal(np.concatenate(gates, axis=1), lw.e_gate)  # (E, F, D)
    np.testing.assert_array_equal(np.concatenate(downs, axis=2), lw.e_down)  # (E, D, F)
    np.testing.assert_array_equal(np.concatenate(shared, axis=1), lw.s_down)  # (D, Fs)
    assert gates[0].shape[1] + gates[1].shape[1] == f and shared[0].shape[1] * 2 == fs


def test_a_stage_keeps_its_layers_sparse_flags():
    m = loaded("qwen3_moe")
    sparse = m.config.moe.sparse
    stages = [Stage.of(m.config, i, 2) for i in range(2)]
    assert sum((st.config(m.config).moe.sparse for st in stages), ()) == sparse
