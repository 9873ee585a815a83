"""The chaos run's timeline: requests ended per second under kills, each kill and the moment
its capacity was back marked."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import pyplot, save_figure

__all__ = ["plot_timeline"]


def plot_timeline(results: Sequence[Mapping[str, Any]], kills: Sequence[Mapping[str, Any]],
                  path: Path, title: str) -> None:
    """Requests ended per second (succeeded, failed, differing) against time, each kill a red
    line, the moment its capacity was back a green one."""
    end = max([r["end"] for r in results] + [1.0])
    bins = np.arange(0, np.ceil(end) + 1)
    fig, ax = pyplot().subplots(figsize=(10, 4))
    series = [("succeeded", [r["end"] for r in results if r["ok"] and not r["differs"]], "tab:blue"),
              ("differing output", [r["end"] for r in results if r["ok"] and r["differs"]], "tab:orange"),
              ("failed", [r["end"] for r in results if not r["ok"]], "tab:red")]
    for label, ends, colour in series:
        counts, _ = np.histogram(ends, bins)
        if label == "succeeded" or counts.any():
            ax.step(bins[:-1], counts, where="post", label=label, color=colour)
    top = ax.get_ylim()[1]
    for k in kills:
        ax.axvline(k["at_s"], color="red", linestyle="--", linewidth=1)
        ax.text(k["at_s"], top * 0.97, f" kill {k['child']}", color="red", fontsize=8, va="top", rotation=90)
        if k.get("back_at_s") is not None:
            ax.axvline(k["back_at_s"], color="green", linestyle=":", linewidth=1)
            ax.text(k["back_at_s"], top * 0.03, f" back {k['back_s']:.1f} s", color="green", fontsize=8,
                    va="bottom", rotation=90)
    ax.set_xlabel("seconds into the load")
    ax.set_ylabel("requests ended per second")
    ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
