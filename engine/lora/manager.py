"""Which adapters are loaded, and which hold the ``max_loras`` slots a step's rows may use.

An adapter is read from its directory when the first request naming it arrives (a bad one is
that request's error) and kept, up to ``max_cpu_loras`` adapters, least recently used out first
(an adapter a live request names is never dropped). A sequence takes a slot when it is admitted:
its adapter's slot if it has one, else a free slot, else the least recently used slot that no
running or swapped sequence uses; with every slot in use it waits (``slot_for`` answers None).
The backend keeps each slot's pairs (``Backend.set_lora``); a step's rows carry their slot.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable

from engine.lora.adapter import LoRAWeights, load_adapter
from engine.lora.request import LoRARequest

log = logging.getLogger("engine")


class LoRAManager:
    def __init__(self, config, model_config, backend):
        self.model_config, self.backend = model_config, backend
        self.max_rank = config.max_lora_rank
        self.max_cpu = config.max_cpu_loras or config.max_loras
        self.loaded: OrderedDict[int, LoRAWeights] = OrderedDict()  # id -> weights, LRU first
        self.requests: dict[int, LoRARequest] = {}  # id -> the request that loaded it
        self.slots: list[int | None] = [None] * config.max_loras  # slot -> adapter id
        self.slot_order: list[int] = list(range(config.max_loras))  # least recently used first

    def load(self, req: LoRARequest, live: Iterable[int] = ()) -> None:
        """Read ``req``'s adapter unless it is loaded (a ValueError names what is wrong with it
        or with the request); ``live``: ids that live requests name (never dropped)."""
        req.check()
        known = self.requests.get(req.lora_int_id)
        if known is not None and known.lora_path != req.lora_path:
            raise ValueError(
                f"LoRARequest: lora_int_id {req.lora_int_id} is adapter {known.lora_name!r} "
                f"({known.lora_path}), not {req.lora_path}"
            )
        if req.lora_int_id in self.loaded:
            self.loaded.move_to_end(req.lora_int_id)
            return
        weights = load_adapter(req.lora_path, self.model_config, self.max_rank, req.lora_name)
        self.loaded[req.lora_int_id] = weights
        self.requests[req.lora_int_id] = req
        log.info(
            "LoRA adapter %r (id %d) loaded: rank %d, %.1f MiB",
            req.lora_name,
            req.lora_int_id,
            weights.rank,
            weights.nbytes / 2**20,
        )
        self._trim(set(live) | set(self.slots) | {req.lora_int_id})

    def _trim(self, keep: set) -> None:
        """Past max_cpu_loras, drop the least recently used adapters not in ``keep``."""
        for lora_id in list(self.loaded):
            if len(self.loaded) <= self.max_cpu:
                return
            if lora_id not in keep:
                del self.loaded[lora_id]
                del self.requests[lora_id]

    def slot_for(self, lora_id: int, busy: Callable[[], set[int]]) -> int | None:
        """The slot adapter ``lora_id`` runs in, loading it there if need be; None while every
        slot holds an adapter that ``busy()`` (the slots of running or swapped sequences) says
        is in use."""
        if lora_id in self.slots:
            slot = self.slots.index(lora_id)
        else:
            in_use = busy()
            free = [s for s in self.slot_order if self.slots[s] is None or s not in in_use]
            if not free:
                return None
            slot = free[0]
            self.slots[slot] = lora_id
            self.backend.set_lora(slot, self.loaded[lora_id])
        self.slot_order.remove(slot)
        self.slot_order.append(slot)
        return slot

    def name_of(self, lora_id: int) -> str:
        return self.requests[lora_id].lora_name
