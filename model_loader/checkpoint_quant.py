"""A Hugging Face checkpoint's ``quantization_config``: read into ``CheckpointQuant`` (or
refused in one line), and its quantized tensors turned into what the engine keeps
(``QuantizedTensors``):
- AWQ (``version: gemm``) and GPTQ, 4 bits, groups a multiple of 32 inputs (or one group a
  row): each layer's qweight/qzeros/scales(/g_idx) -> its ``weight`` as q4_z blocks, the
  same values (model_loader.int4_checkpoint);
- MXFP4 (gpt-oss's experts): their ``*_blocks`` and ``*_scales`` repacked into GGUF's MXFP4
  blocks at load, the same values (model_loader.moe, model_loader.mxfp4); the modules the
  config leaves unconverted are plain tensors;
- FP8 (``fmt: e4m3``): each float8_e4m3fn ``weight`` with its ``weight_scale`` (a scalar, one
  per output channel) or ``weight_scale_inv`` (one per ``weight_block_size`` block) -> an
  ``Fp8Matrix``, kept in 8 bits (model_loader.fp8_checkpoint). Activations stay float32: a
  static ``input_scale`` is read past.
Tensors are converted when asked for, so a layer's are made as the backend packs it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

log = logging.getLogger("model_loader")

SUPPORTED = (
    "AWQ gemm and GPTQ (4 bits, groups a multiple of 32, no act-order), FP8 e4m3, MXFP4 "
    "(gpt-oss's experts)"
)
AWQ_VERSIONS = ("gemm",)
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what the stored zeros lack


@dataclass(frozen=True)
class CheckpointQuant:
    method: str  # "awq" | "gptq" | "fp8" | "mxfp4"
    group_size: int = 0  # AWQ/GPTQ: inputs a group; -1: one group a row
    zero_offset: int = 0  # GPTQ v1: a stored zero is the zero minus this (1)
    weight_block: tuple[int, int] | None = None  # FP8: a scale's (rows, cols), None: per tensor
    #   or per channel

    def summary(self) -> str:
        if self.method == "mxfp4":
            return "mxfp4 experts"
        if self.method == "fp8":
            return "fp8 e4m3" + (f", blocks {self.weight_block}" if self.weight_block else "")
        return f"{self.method} 4-bit, groups of {self.group_size}"


def _refuse(what: str) -> ValueError:
    return ValueError(f"config.json: quantization_config {what} is not supported ({SUPPORTED})")


def parse_quantization(q) -> CheckpointQuant | None:
    """config.json's quantization_config -> CheckpointQuant; None for none."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise _refuse(f"{q!r}")
    method = str(q.get("quant_method", "")).lower()
    if method in ("awq", "gptq"):
        return _int4(q, method)
    if method == "fp8":
        return _fp8(q)
    if method == "mxfp4":
        skip = q.get("modules_to_not_convert", [])
        if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
            raise _refuse(f"mxfp4 modules_to_not_convert {skip!r} (not a list of names)")
        return CheckpointQuant("mxfp4")
    raise _refuse(f"quant_method {q.get('quant_method')!r}")


def _int4(q: dict, method: str) -> CheckpointQuant:
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise _refuse(f"{method} bits={bits!r}")
    group = q.get("group_size", q.get("q_group_size"))
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 32 == 0)):
        raise _refuse(f"{method} group_size={group!r} (not a multiple of 32)")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version not in AWQ_VERSIONS:
            raise _refuse(f"awq version {q.get('version')!r}")
        if q.get("zero_point", True) is not True:
            raise _refuse("awq zero_point=false")
        return CheckpointQuant("awq", group)
    if q.get("desc_act"):
        raise _refuse("gptq desc_act=true (act-order)")
    if q.get("is_marlin_format") or q.get("dynamic"):
        key = "is_marlin_format" if q.get("is_marlin_format") else "dynamic"
        raise _refuse(f"gptq {key}={q[key]!r}")
    fmt = str(q.get("checkpoint_format", q.get("format", "gptq"))).lower()
    if fmt not in GPTQ_FORMATS:
        raise _refuse(f"gptq checkpoint_format {fmt!r}")
    return CheckpointQuant("gptq", group, GPTQ_FORMATS[fmt])


def _fp8(q: dict) -> CheckpointQuant:
    fmt = str(q.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _refuse(f"fp8 fmt {q.get('fmt')!r}")
    if q.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise _refuse(f"fp8 activation_scheme {q['activation_scheme']!r}")
    block = q.get("weight_block_size")
    if block is not None:
        if not (
            isinstance(block, list | tuple)
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise _refuse(f"fp8 weight_block_size {block!r}")
        block = (int(block[0]), int(block[1]))
    return CheckpointQuant("fp8", weight_block=block)


E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_SCALES = ("weight_scale", "weight_scale_inv")
FP8_IGNORED = ("input_scale",)  # static activation scales: activations stay float32 here


class QuantizedTensors(Mapping):
    """The checkpoint's tensors with each quantized layer's in place of its ``P.weight``:
    ``P.weight`` made on demand (a ZeroPointBlocks, an Fp8Matrix); ``shape(name)``
    without making it."""

    def __init__(self, tensors: Mapping[str, np.ndarray], spec: CheckpointQuant):
        self._tensors, self.spec = tensors, spec
        self._made: dict[str, tuple[int, int]] = {}  # P.weight -> (N, K), made on demand
        self._used: set[str] = set()
        if spec.method == "fp8":
            self._find_fp8()
        else:
            self._find_int4()

    def _find_int4(self) -> None:
        from model_loader import int4_checkpoint as int4  # (imports gguf: only when needed)

        for name in self._tensors:
            if name.endswith(".qweight"):
                prefix = name[: -len(".qweight")]
                parts = [p for p in int4.int4_parts(prefix, self.spec.method) if p in self._tensors]
                missing = {prefix + ".qzeros", prefix + ".scales"} - set(parts)
                if missing:
                    raise ValueError(f"checkpoint: missing tensor {sorted(missing)[0]!r}")
                rows, cols = self._tensors[name].shape
                awq = self.spec.method == "awq"
                self._made[prefix + ".weight"] = (cols * 8, rows) if awq else (cols, rows * 8)
                self._used.update(parts)
        if not self._made:
            raise ValueError(f"checkpoint: {self.spec.method} config but no tensor '*.qweight'")

    def _find_fp8(self) -> None:
        for name, t in self._tensors.items():
            if name.endswith(".weight") and t.dtype == E4M3:
                prefix = name[: -len(".weight")]
                scales = [prefix + "." + s for s in FP8_SCALES if prefix + "." + s in self._tensors]
                if len(scales) != 1:
                    raise ValueError(
                        f"checkpoint: {name} (float8_e4m3fn) needs one of "
                        f"{prefix}.weight_scale or .weight_scale_inv, has {len(scales)}"
                    )
                self._made[name] = tuple(t.shape)
                self._used.update(scales + [prefix + "." + s for s in FP8_IGNORED])
        if not self._made:
            raise ValueError("checkpoint: fp8 config but no float8_e4m3fn weight")
        from model_loader.fp8_checkpoint import log_fp8

        log_fp8(self._tensors, list(self._made))

    def __getitem__(self, name: str):
        if name in self._made:
            return self._make(name[: -len(".weight")])
        if name in self._used or name not in self._tensors:
            raise KeyError(name)
        return self._tensors[name]

    def _make(self, prefix: str):
        from model_loader import int4_checkpoint as int4

        spec, t = self.spec, self._tensors
        if spec.method == "awq":
            return int4.awq_matrix(prefix, t, spec.group_size)
        if spec.method == "gptq":
            return int4.gptq_matrix(prefix, t, spec.group_size, spec.zero_offset)
        from model_loader.fp8_checkpoint import fp8_matrix

        return fp8_matrix(prefix, t, spec.weight_block)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._made[name] if name in self._made else tuple(self._tensors[name].shape)

    def __contains__(self, name) -> bool:
        return name in self._made or (name in self._tensors and name not in self._used)

    def __iter__(self):
        yield from (n for n in self._tensors if n not in self._used and n not in self._made)
        yield from self._made

    def __len__(self) -> int:
        return sum(1 for _ in self)
