"""Small arithmetic shared by the engine: ceiling division and byte units."""

from __future__ import annotations

MiB = 1 << 20
GiB = 1 << 30


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for positive b: the blocks that ``a`` tokens need at ``b`` per block."""
    return -(a // -b)


def mib(n: int) -> str:
    """A byte count for a log line: ``1,234.5 MiB``."""
    return f"{n / MiB:,.1f} MiB"
