"""PNG charts of the benchmarks (``--plot DIR`` of ``engine.bench`` and ``engine.bench_serve``).

Each chart is one function over plain lists and dicts (milliseconds, tokens/s), so it runs without
an engine. matplotlib is imported on the first chart only, with the Agg backend (no display): the
benchmarks need it only when ``--plot`` is given (``pip install '.[plot]'``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DPI = 100
SIZE = (8, 3.6)  # inches: 800 x 360 pixels at DPI


def pyplot():
    """matplotlib.pyplot on the Agg backend; a ValueError saying how to install it if missing."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install '.[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_dir(path: str) -> Path:
    """The ``--plot`` folder, made if missing; a ValueError naming it if it cannot be."""
    d = Path(path)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--plot {path!r}: {e.strerror}") from None
    return d


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)
    return path


def _cdf(ax, values_ms: list[float], name: str) -> None:
    """One latency CDF with its p50 and p99 as dashed lines labelled in the legend."""
    if not values_ms:
        ax.text(0.5, 0.5, f"no {name} samples", ha="center", transform=ax.transAxes)
        ax.set_xlabel(f"{name} (ms)")
        return
    xs = np.sort(np.asarray(values_ms, dtype=float))  # (N,)
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", color="tab:blue", lw=1.8)
    for q, color in ((50, "tab:green"), (99, "tab:red")):
        v = float(np.percentile(xs, q))
        ax.axvline(v, color=color, ls="--", lw=1.2, label=f"p{q} {v:.1f} ms")
    if xs[0] > 0 and xs[-1] / xs[0] > 30:  # a long tail: log scale keeps the bulk readable
        _log_axis(ax, np.log10(xs[-1] / xs[0]))
    ax.set_xlabel(f"{name} (ms{', log scale' if ax.get_xscale() == 'log' else ''})")
    ax.set_ylabel("fraction of samples")
    ax.set_title(f"{name}: {len(xs)} samples")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)


def _log_axis(ax, decades: float) -> None:
    """A log x axis written as plain numbers, ticks at 1, 2 and 5 of each decade when there
    are room for them (under 2.5 decades), else at the powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0) if decades < 2.5 else (1.0,)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def latency_cdfs(path: Path, ttft_ms: list[float], itl_ms: list[float], title: str) -> Path:
    """Time to first token and inter-token latency, each as a CDF with p50 / p99 marked."""
    fig, axes = pyplot().subplots(1, 2, figsize=SIZE)
    _cdf(axes[0], ttft_ms, "TTFT")
    _cdf(axes[1], itl_ms, "ITL")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def step_split(path: Path, parts_ms: dict[str, float], floor_ms: float, title: str) -> Path:
    """One decode step's mean time as a stacked bar of its parts (label -> ms), above a bar of
    the matrix products alone: how far the step is from its matmul floor."""
    fig, ax = pyplot().subplots(figsize=(9, 3.6))
    left = 0.0
    colors = pyplot().get_cmap("tab10").colors
    for i, (label, ms) in enumerate(parts_ms.items()):
        ax.barh(1, ms, left=left, color=colors[i % 10], label=f"{label} {ms:.1f} ms")
        left += ms
    floor_label = f"matrix products alone {floor_ms:.1f} ms"
    ax.barh(0, floor_ms, color="black", hatch="//", label=floor_label)
    ax.text(left, 1, f" {left:.1f} ms\n = {left / floor_ms:.2f}x floor", va="center", fontsize=9)
    ax.text(floor_ms, 0, f" {floor_ms:.1f} ms", va="center", fontsize=9)
    ax.set_yticks([0, 1], ["matmul floor", "decode step"])
    ax.set_xlim(0, max(left, floor_ms) * 1.3)
    ax.set_xlabel("time per step (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def throughput_sweep(path: Path, xs: list[float], tok_per_s: list[float], xlabel: str, title: str):
    """Output tokens/s against the swept value (concurrency or request rate), points labelled."""
    fig, ax = pyplot().subplots(figsize=SIZE)
    ax.plot(xs, tok_per_s, "o-", color="tab:blue", lw=1.8)
    for x, y in zip(xs, tok_per_s, strict=True):
        ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center")
    if min(xs) > 0 and max(xs) / min(xs) >= 8:
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_ylim(0, max(tok_per_s) * 1.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    return _save(fig, path)
