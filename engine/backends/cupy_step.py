"""The GPU backend's step data: a layer's weights on the device, a step's inputs as views of one
uploaded buffer, and the workspace every layer of a step reuses; ``on_device``, which runs a
backend method on the device's stream."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from engine.backends.forward_batch import ForwardBatch


@dataclass
class DeviceLayer:
    attn_norm: object  # (D,)
    w_qkv: object  # (H*hd + 2*Hkv*hd, D): q | k | v rows, (out, in) as in the checkpoint
    w_o: object  # (D, H*hd)
    mlp_norm: object  # (D,)
    w_gate_up: object  # (2F, D): gate | up rows (None in a layer of experts)
    w_down: object  # (D, F)
    b_qkv: object = None  # (H*hd + 2*Hkv*hd,) q | k | v biases (Qwen2), added by rotary_cache
    q_norm: object = None  # (hd,) per-head norms of q and k (Qwen3), in rotary_cache
    k_norm: object = None  # (hd,)
    post_attn_norm: object = None  # (D,) norms of the attention's and the MLP's outputs
    post_mlp_norm: object = None  # (D,) (Gemma 2 and 3)
    b_o: object = None  # (D,) float32 the o projection's bias (gpt-oss)
    sinks: object = None  # (H,) float32 each head's sink logit (gpt-oss)
    experts: object = None  # a layer of experts (engine/backends/cupy_moe.py) in place of the MLP


@dataclass
class StepInputs:
    """One step's int32 metadata on the device (views into one uploaded buffer)."""

    token_ids: object  # (T,)
    positions: object  # (T,)
    slot_mapping: object  # (T,)
    context_lens: object  # (B,)
    block_tables: object  # (B, M)
    prefill_qsl: object | None  # (B - nd + 1,) query starts of the prefills, from 0
    rows: object | None  # (R,) the rows whose logits are wanted; None when every row is
    # LoRA rows (enable_lora): (order (T,), tiles (n, 3), the step's slots) as
    # engine/kernels/launch.py lora_tiles makes them; None when every row runs the base model
    lora: tuple | None = None
    # KV groups: each group's after the first (T,) slots and (B, M) page tables, and the
    # layer -> (group, slot) map (a KVGroups); None: one group, layer l in slot l
    group_slots: tuple = ()
    group_tables: tuple = ()
    kv_groups: object = None

    def for_layer(self, layer: int) -> tuple[int, object, object]:
        """(the KV slot layer ``layer`` uses, its group's (T,) slots and (B, M) tables)."""
        groups = self.kv_groups
        if groups is None:
            return layer, self.slot_mapping, self.block_tables
        g, slot = groups.layer_group[layer], groups.layer_slot[layer]
        if g == 0:
            return slot, self.slot_mapping, self.block_tables
        return slot, self.group_slots[g - 1], self.group_tables[g - 1]


@dataclass
class Workspace:
    residual: object  # (T, D)
    x: object  # (T, D) each block's output
    h: object  # (T, D) normalized
    qkv: object  # (T, H*hd + 2*Hkv*hd): q | k | v rows of the QKV product
    q: object  # (T, H, hd) rotated
    attn: object  # (T, H, hd)
    gate_up: object  # (T, 2F)
    act: object  # (T, F)
    last_x: object  # (B, D) rows whose logits are needed
    last_res: object  # (B, D)
    last_h: object  # (B, D)
    logits: object  # (B, V) float32
    branch: object = None  # (T, D) a branch's output before its norm (sandwich norms only)


def pack_inputs(b: ForwardBatch, lora: tuple | None = None) -> np.ndarray:
    """token_ids | positions | slots | context_lens | prefill starts | rows | block_tables,
    then with ``lora`` (``lora_tiles``' (order, tiles)) order | tiles, then each other KV
    group's slots, then each one's block tables."""
    nd, qsl = b.num_decodes, b.query_start_loc
    parts = [b.token_ids, b.positions, b.slot_mapping, b.context_lens, qsl[nd:] - qsl[nd]]
    parts += [b.output_rows, b.block_tables.ravel(), *(lora or ())]
    parts += [*b.group_slots, *(t.ravel() for t in b.group_tables)]
    return np.concatenate([np.asarray(p, dtype=np.int32).ravel() for p in parts])  # (n,)


def split_inputs(
    flat,
    T: int,
    B: int,
    nd: int,
    M: int,
    R: int | None = None,
    tiles: int | None = None,
    groups: int = 0,
) -> StepInputs:
    """The views of ``pack_inputs``'s layout over a device buffer; R output rows (B unless a
    speculated run wants all of its rows); ``tiles``: the LoRA tiles packed after them;
    ``groups``: the KV groups after the first, whose slots and tables come last."""
    R = B if R is None else R
    sizes = [T, T, T, B, B - nd + 1, R, B * M] + ([] if tiles is None else [T, 3 * tiles])
    sizes += [T] * groups + [B * M] * groups
    ends = np.cumsum(sizes)
    v = [flat[e - s : e] for s, e in zip(sizes, ends, strict=True)]
    rows = v[5] if T != R else None  # every row wanted: no gather
    inp = StepInputs(v[0], v[1], v[2], v[3], v[6].reshape(B, M), v[4], rows)
    if tiles is not None:
        inp.lora = (v[7], v[8].reshape(tiles, 3))
    if groups:
        rest = v[len(v) - 2 * groups :]
        inp.group_slots = tuple(rest[:groups])
        inp.group_tables = tuple(t.reshape(B, M) for t in rest[groups:])
    return inp


def on_device(method):
    """Run a backend method inside ``device.active()``: on a GPU, every launch, copy and cuBLAS
    call goes to the device's stream, whatever stream the calling thread has current."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.device.active():
            return method(self, *args, **kwargs)

    return run
