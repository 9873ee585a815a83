"""``benchmarks.serving.interference_bench``'s arithmetic and report: inter-token gaps from token
times, percentiles, one run's figures, the old and new modes against the baseline (the excess
cut), the targets, the summary over rounds, the table and the plot. Pure functions over the
bench's records (``interference_bench`` runs the engines and the store)."""

from __future__ import annotations

import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import pyplot, save_figure

__all__ = ["MODES", "TARGET_P99_RATIO", "TARGET_EXCESS_CUT", "TARGET_TTFT_EXTRA_STEPS", "stream_gaps",
           "percentile", "rounded", "run_figures", "excess_cut", "compare", "targets_met", "summarize",
           "segment_order", "table", "plot"]

MODES = ("baseline", "old", "new")
TARGET_P99_RATIO = {"shm": 1.15, "tcp": 1.3}
TARGET_EXCESS_CUT = 0.7
TARGET_TTFT_EXTRA_STEPS = 1.0


def stream_gaps(times: Mapping[str, Sequence[float]], skip: Collection[float] = ()) -> list[float]:
    """Inter-token latencies: the gaps between each stream's consecutive token times, but
    those ending at a time in ``skip`` (the end of a step that computed an arrival)."""
    skip = set(skip)
    return [b - a for ts in times.values() for a, b in zip(ts, ts[1:]) if b not in skip]


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def rounded(x: float, nd: int = 3) -> float:
    return round(float(x), nd)


def run_figures(gaps: Sequence[float], decode_gaps: Sequence[float], steps: Sequence[float],
                ttfts: Sequence[float], window_s: float, load_s: float) -> dict[str, Any]:
    """One run's figures from its raw samples (seconds): see the module docstring."""
    out: dict[str, Any] = {}
    for prefix, xs in (("", gaps), ("decode_", decode_gaps)):
        for q in (50, 90, 99):
            out[f"{prefix}p{q}_itl_ms"] = rounded(percentile(xs, q) * 1e3)
        out[f"{prefix}mean_itl_ms"] = rounded(statistics.fmean(xs) * 1e3)
        out[f"{prefix}gaps"] = len(xs)
    return {
        **out, "steps": len(steps), "step_ms": rounded(statistics.median(steps) * 1e3),
        "ttft_ms": rounded(statistics.median(ttfts) * 1e3) if ttfts else None,
        "window_s": rounded(window_s), "inflight_frac": rounded(sum(ttfts) / window_s) if window_s else None,
        "load_frac": rounded(load_s / window_s) if window_s else None,
    }


def excess_cut(old_ratio: float, new_ratio: float) -> float | None:
    """The share of the old path's excess over baseline (ratio - 1) that the new path removes;
    None when the old path has no excess to cut."""
    excess_old = old_ratio - 1.0
    if excess_old <= 0:
        return None
    return 1.0 - (new_ratio - 1.0) / excess_old


def compare(base: Mapping[str, Any], old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """Old and new against baseline, measured in the same run (module docstring)."""
    out: dict[str, Any] = {}
    for prefix in ("", "decode_"):
        for name, run in (("old", old), ("new", new)):
            for q in ("p50", "p99"):
                out[f"{name}_{prefix}{q}_itl_ratio"] = rounded(run[f"{prefix}{q}_itl_ms"]
                                                          / base[f"{prefix}{q}_itl_ms"])
        out[f"{prefix}excess_old"] = rounded(out[f"old_{prefix}p99_itl_ratio"] - 1)
        out[f"{prefix}excess_new"] = rounded(out[f"new_{prefix}p99_itl_ratio"] - 1)
        cut = excess_cut(out[f"old_{prefix}p99_itl_ratio"], out[f"new_{prefix}p99_itl_ratio"])
        out[f"{prefix}excess_cut"] = None if cut is None else rounded(cut)
    out["ttft_old_ms"], out["ttft_new_ms"] = old["ttft_ms"], new["ttft_ms"]
    out["ttft_extra_steps"] = rounded((new["ttft_ms"] - old["ttft_ms"]) / base["step_ms"], 2)
    return out


def targets_met(comparisons: Mapping[str, Mapping[str, Mapping[str, Any]]],
                decode_only: bool = False) -> dict[str, bool]:
    """``{"shm.n4.p99_itl_ratio": True, ...}``: each target of each (store, N); with
    ``decode_only`` the two ITL targets on the decode-only p99 (no TTFT flag)."""
    pre = "decode_" if decode_only else ""
    met: dict[str, bool] = {}
    for store, by_n in comparisons.items():
        for n, c in by_n.items():
            cut, new_excess = c[f"{pre}excess_cut"], c[f"{pre}excess_new"]
            met[f"{store}.{n}.{pre}p99_itl_ratio"] = (c[f"new_{pre}p99_itl_ratio"]
                                                      <= TARGET_P99_RATIO[store])
            met[f"{store}.{n}.{pre}excess_cut"] = (cut is None and new_excess <= 0) or (
                cut is not None and cut >= TARGET_EXCESS_CUT)
            if not decode_only:
                met[f"{store}.{n}.ttft_extra_steps"] = c["ttft_extra_steps"] <= TARGET_TTFT_EXTRA_STEPS
    return met


def summarize(runs: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """``runs[store][nN][mode]`` -> comparisons, before/after, targets and met flags."""
    comparisons = {store: {n: compare(r["baseline"], r["old"], r["new"]) for n, r in by_n.items()}
                   for store, by_n in runs.items()}
    side: dict[str, dict[str, Any]] = {"before": {}, "after": {}}
    for store, by_n in comparisons.items():
        for when, path in (("before", "old"), ("after", "new")):
            side[when][store] = {n: {"p50_itl_ratio": c[f"{path}_p50_itl_ratio"],
                                     "p99_itl_ratio": c[f"{path}_p99_itl_ratio"],
                                     "decode_p99_itl_ratio": c[f"{path}_decode_p99_itl_ratio"],
                                     "ttft_ms": c[f"ttft_{path}_ms"],
                                     "inflight_frac": runs[store][n][path]["inflight_frac"]}
                                 for n, c in by_n.items()}
    met = targets_met(comparisons)
    return {
        "compare": comparisons, **side,
        "targets": {"shm_p99_itl_ratio_max": TARGET_P99_RATIO["shm"],
                    "tcp_p99_itl_ratio_max": TARGET_P99_RATIO["tcp"],
                    "excess_cut_min": TARGET_EXCESS_CUT,
                    "ttft_extra_steps_max": TARGET_TTFT_EXTRA_STEPS},
        "met": met, "all_met": all(met.values()),
        "met_decode_only": targets_met(comparisons, decode_only=True),
    }


def segment_order(rounds: int) -> list[str]:
    """The modes' segments, one of each per round, the order rotated every round."""
    return [MODES[(r + i) % len(MODES)] for r in range(rounds) for i in range(len(MODES))]


def table(result: Mapping[str, Any]) -> str:
    """The figures as a Markdown table (docs/benchmarks.md)."""
    lines = ["| store | N | p99 ITL / baseline: old | new | decode steps only: old | new | "
             "p50 ITL / baseline: old | new | excess cut (all / decode only) | TTFT old (ms) | "
             "TTFT new (ms) | new - old (steps) | load busy: old | new |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: | ---: |"]

    def cut(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for store, by_n in result["compare"].items():
        for n, c in by_n.items():
            run = result["runs"][store][n]
            lines.append(
                f"| {store} | {n[1:]} | {c['old_p99_itl_ratio']:.2f} | **{c['new_p99_itl_ratio']:.2f}** | "
                f"{c['old_decode_p99_itl_ratio']:.2f} | {c['new_decode_p99_itl_ratio']:.2f} | "
                f"{c['old_p50_itl_ratio']:.2f} | {c['new_p50_itl_ratio']:.2f} | "
                f"{cut(c['excess_cut'])} / {cut(c['decode_excess_cut'])} | "
                f"{c['ttft_old_ms']:.0f} | {c['ttft_new_ms']:.0f} | {c['ttft_extra_steps']:+.2f} | "
                f"{run['old']['load_frac']:.2f} | {run['new']['load_frac']:.2f} |")
    return "\n".join(lines)


def plot(result: Mapping[str, Any], path: Path) -> None:
    """Grouped bars of the p99 ITL ratio over baseline per (store, N), old against new: all
    gaps (left), decode-only steps (right); lines at 1.0 and at each store's target."""
    plt = pyplot()

    groups = [(s, n) for s, by_n in result["compare"].items() for n in by_n]
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 3.0 * len(groups) + 2.0), 4.4), sharey=True)
    width = 0.36
    panels = (("", "every gap (the target's figure)"),
              ("decode_", "decode-only steps (no arrival computed in the step)"))
    for ax, (pre, title) in zip(axes, panels):
        for k, (label, key, color) in enumerate((("old: loads on the engine thread", "old", "#c44e52"),
                                                 ("new: loads on I/O threads", "new", "#4c72b0"))):
            xs = [i + (k - 0.5) * width for i in range(len(groups))]
            ys = [result["compare"][s][n][f"{key}_{pre}p99_itl_ratio"] for s, n in groups]
            bars = ax.bar(xs, ys, width, label=label, color=color)
            ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=8, padding=2)
        ax.axhline(1.0, color="black", lw=0.8)
        for i, (s, _) in enumerate(groups):
            ax.hlines(TARGET_P99_RATIO[s], i - 0.45, i + 0.45, colors="green",
                      linestyles="--", label="target (new)" if i == 0 else "_nolegend_")
        ax.set_xticks(range(len(groups)), [f"{s}, N = {n[1:]}" for s, n in groups])
        ax.set_title(f"p99 ITL / baseline: {title}", fontsize=9)
    axes[0].set_ylabel("p99 inter-token latency / baseline (no load)")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("Running streams' ITL while prompts' KV loads from the store", fontsize=11)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
