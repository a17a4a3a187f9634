"""``LoRARequest``: the adapter a request runs with, in vLLM's shape."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """``LoRARequest(lora_name, lora_int_id, lora_path)``: a PEFT adapter directory, known to
    the engine by its integer id (>= 1, unique per adapter) and its name."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def check(self) -> None:
        """A ValueError naming a bad field."""
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(
                f"LoRARequest: lora_name must be a non-empty string, got {self.lora_name!r}"
            )
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(
                f"LoRARequest: lora_int_id must be an integer, got {self.lora_int_id!r}"
            )
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest: lora_int_id must be at least 1, got {self.lora_int_id}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(
                f"LoRARequest: lora_path must be a directory's path, got {self.lora_path!r}"
            )
