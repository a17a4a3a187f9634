"""KV cache groups: a model whose layers attend differently (Gemma 2's sliding and global layers,
Gemma 3's five sliding per global) keeps each kind's blocks apart, so the sliding layers give back
what their window no longer sees while the global layers keep every block.

The layers of one attention kind (full, or sliding with window W) form groups of ``num_slots``
(G) layers each: G is the smallest kind's layer count, so every group fills the same G "slot"
tensors and a block id is a page of one size, G layers deep. The last group of a larger kind is
padded (its spare slots hold nothing). The pool is ``(G, 2, num_blocks, bs, Hkv, hd)``: layer l
reads and writes slot ``layer_slot[l]`` through the page table of group ``layer_group[l]``. One
pool of block ids; each group has its own page table per sequence; a block id belongs to one
group at a time. Group 0 is the full-attention group when there is one.

A model of one kind (every layer full, or every layer sliding with one window) is one group of
all its layers, one slot per layer: exactly the ungrouped layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GROUPING = True  # False: every model is one group (tests compare a grouped run against it)


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int, ...]  # per group: its sliding window (0: full attention)
    layers: tuple[tuple[int, ...], ...]  # per group: its layers; the i-th uses slot i
    num_slots: int  # G: layers a block holds
    layer_group: tuple[int, ...] = field(init=False)  # per layer: its group
    layer_slot: tuple[int, ...] = field(init=False)  # per layer: its slot

    def __post_init__(self):
        n = sum(len(ls) for ls in self.layers)
        group, slot = [0] * n, [0] * n
        for g, ls in enumerate(self.layers):
            if len(ls) > self.num_slots:
                raise ValueError(f"KVGroups: group {g} has {len(ls)} layers > {self.num_slots}")
            for s, layer in enumerate(ls):
                group[layer], slot[layer] = g, s
        object.__setattr__(self, "layer_group", tuple(group))
        object.__setattr__(self, "layer_slot", tuple(slot))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def grouped(self) -> bool:
        return len(self.windows) > 1

    def describe(self) -> str:
        """One line: each kind's groups (for the memory plan's startup line)."""
        kinds: dict[int, list[int]] = {}
        for w, ls in zip(self.windows, self.layers, strict=True):
            kinds.setdefault(w, []).append(len(ls))
        parts = [
            f"{'full' if w == 0 else f'sliding {w}'}: {len(sizes)} of {sum(sizes)} layers"
            for w, sizes in kinds.items()
        ]
        return f"{self.num_groups} KV groups of {self.num_slots} slots ({'; '.join(parts)})"

    def layout(self) -> str:
        """The layout in one line (the KV tiers' cache key): each group's window and layers."""
        groups = ";".join(
            f"{w}:{','.join(map(str, ls))}" for w, ls in zip(self.windows, self.layers, strict=True)
        )
        return f"{self.num_slots} slots|{groups}"

    def stage(self, layers: range) -> KVGroups:
        """The groups as a pipeline stage that runs ``layers`` holds them: each group's layers
        among those, numbered from the stage's first (group ids kept: a group may have none
        there), its slots re-based (the i-th of a group's layers there uses slot i), as many
        slots as the stage's largest group needs."""
        local = tuple(tuple(i - layers.start for i in ls if i in layers) for ls in self.layers)
        return KVGroups(self.windows, local, max(1, *map(len, local)))

    def stage_slots(self, layers: range, group: int) -> list[tuple[int, int]]:
        """(the stage's slot, the whole block's slot) of each of ``group``'s layers that the
        stage running ``layers`` holds (``stage``'s slots)."""
        mine = [i for i in self.layers[group] if i in layers]
        return [(j, self.layer_slot[i]) for j, i in enumerate(mine)]


def layer_groups(windows: list[int] | tuple[int, ...], enabled: bool | None = None) -> KVGroups:
    """The groups of a model whose layer l slides with ``windows[l]`` (0: full attention);
    ``enabled`` False (default: GROUPING): one group of every layer, with the window they all
    share (0 where they differ: every block kept)."""
    enabled = GROUPING if enabled is None else enabled
    n = len(windows)
    if n == 0:
        raise ValueError("layer_groups: a model with no layers")
    kinds: dict[int, list[int]] = {}
    for w in sorted(set(windows)):  # full attention (0) first
        kinds[w] = [layer for layer in range(n) if windows[layer] == w]
    if len(kinds) == 1 or not enabled:
        window = windows[0] if len(kinds) == 1 else 0
        return KVGroups((window,), (tuple(range(n)),), n)
    size = min(len(ls) for ls in kinds.values())
    groups, group_windows = [], []
    for w, ls in kinds.items():
        for i in range(0, len(ls), size):
            groups.append(tuple(ls[i : i + size]))
            group_windows.append(w)
    return KVGroups(tuple(group_windows), tuple(groups), size)


def model_groups(model_config, enabled: bool | None = None) -> KVGroups:
    """``layer_groups`` of a ModelConfig's layer windows."""
    c = model_config
    return layer_groups([c.window(i) for i in range(c.num_hidden_layers)], enabled)
