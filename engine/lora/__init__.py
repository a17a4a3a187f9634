"""LoRA adapters over one copy of the base weights: PEFT's format, served batched.

request.py   ``LoRARequest`` (vLLM's: a name, an integer id, a path), as a request names one
adapter.py   a PEFT directory -> ``LoRAWeights``: per layer, the low-rank pair of each of the
             engine's four fused matrices, checked against the model
manager.py   which adapters are loaded (``max_cpu_loras``) and which hold one of the
             ``max_loras`` slots a step may use; a sequence's slot
"""

from engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
