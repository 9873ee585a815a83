"""PNG plots of serving benchmarks (matplotlib, Agg backend).

- ``plot_cdfs``: one run's TTFT, TPOT and ITL distributions.
- ``plot_latency_vs_rate``: TTFT and TPOT (p50 solid, p99 dashed) against request rate, one
  colour per configuration, objectives as grey lines.
- ``plot_goodput_vs_rate``: goodput (req/s) and SLO attainment against rate, with the 90% line.
- ``plot_attainment_vs_slo_scale``: DistServe's curve, attainment against a multiple of the SLO.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from planner.metrics import RequestResult

__all__ = ["plot_cdfs", "plot_latency_vs_rate", "plot_goodput_vs_rate", "plot_attainment_vs_slo_scale"]


def _save(fig: Any, path: Path, title: str) -> None:
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _attainment_axis(ax: Any) -> None:
    """Attainment in percent, with the 90% line."""
    ax.axhline(90, color="grey", linestyle=":", label="90%")
    ax.set_ylabel("requests meeting both objectives (%)")
    ax.set_ylim(0, 102)


def _cdf(ax: Any, values: Sequence[float], label: str, slo: float | None = None) -> None:
    xs = np.sort(np.asarray(values, dtype=float) * 1e3)
    if xs.size:
        ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post")
    if slo is not None:
        ax.axvline(slo * 1e3, color="grey", linestyle=":", label="objective")
        ax.legend(loc="lower right")
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of requests" if label != "ITL" else "fraction of gaps")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def plot_cdfs(results: Sequence[RequestResult], path: Path, title: str,
              slo: tuple[float, float] | None = None) -> None:
    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    _cdf(axes[0], [r.ttft_s for r in ok if r.ttft_s is not None], "TTFT", slo[0] if slo else None)
    _cdf(axes[1], [r.tpot_s for r in ok if r.tpot_s is not None], "TPOT", slo[1] if slo else None)
    _cdf(axes[2], [x for r in ok for x in r.itl_s], "ITL")
    _save(fig, path, title)


Curves = Mapping[str, Sequence[Mapping[str, Any]]]  # configuration -> its sweep points


def _get(p: Mapping[str, Any], metric: str, stat: str) -> float:
    d = p["summary"].get(metric)
    return float("nan") if d is None else d[stat] * 1e3


def plot_latency_vs_rate(curves: Curves, path: Path, title: str,
                         slo: Mapping[str, tuple[float, float]] | None = None) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, points) in enumerate(curves.items()):
        color = f"C{i}"
        rates = [p["rate"] for p in points]
        for ax, metric in zip(axes, ("ttft_s", "tpot_s")):
            ax.plot(rates, [_get(p, metric, "p50") for p in points], "o-", color=color, label=f"{name} p50")
            ax.plot(rates, [_get(p, metric, "p99") for p in points], "s--", color=color, label=f"{name} p99")
            if slo and name in slo:
                ax.axhline(slo[name][0 if metric == "ttft_s" else 1] * 1e3, color=color, alpha=0.35, linestyle=":")
    for ax, label in zip(axes, ("TTFT", "TPOT")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    _save(fig, path, title)


def plot_goodput_vs_rate(curves: Curves, path: Path, title: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, points) in enumerate(curves.items()):
        rates = [p["rate"] for p in points]
        axes[0].plot(rates, [p["summary"]["goodput"] for p in points], "o-", color=f"C{i}", label=name)
        axes[1].plot(rates, [100 * p["summary"]["attainment"] for p in points], "o-", color=f"C{i}", label=name)
    top = max((p["rate"] for pts in curves.values() for p in pts), default=1.0)
    axes[0].plot([0, top], [0, top], color="grey", linestyle=":", label="offered rate")
    axes[0].set_ylabel("goodput (req/s meeting both objectives)")
    _attainment_axis(axes[1])
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path, title)


def plot_attainment_vs_slo_scale(curves: Mapping[str, tuple[float, Sequence[float], Sequence[float]]],
                                 path: Path, title: str) -> None:
    """``curves``: configuration -> (the rate shown, scales, attainment at each scale)."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for i, (name, (rate, scales, att)) in enumerate(curves.items()):
        ax.plot(scales, [100 * a for a in att], "o-", color=f"C{i}", label=f"{name} @ {rate:g} req/s")
    _attainment_axis(ax)
    ax.axvline(1.0, color="grey", linestyle="--", alpha=0.5)
    ax.set_xlabel("SLO scale (x the objectives)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path, title)

