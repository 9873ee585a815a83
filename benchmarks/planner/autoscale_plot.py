"""The autoscaling benchmark's figure (``benchmarks/planner/autoscale_bench.py`` writes its record;
this draws ``OUT/autoscale.png`` from it): the autoscaled cluster's layout, pools' pressures and
role changes over time; its attainment beside the best static layout's in time bins; and every
layout's goodput over the whole run and each half."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report import pyplot, save_figure

__all__ = ["plot"]


def plot(record: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    configs, half = record["configs"], record["workload"]["phase_seconds"]
    auto = configs.get("autoscaled", {})
    best = record["verdict"].get("best_static")
    fig, axes = plt.subplots(3, 1, figsize=(10, 10), gridspec_kw={"height_ratios": [2, 1.4, 1.6]})
    ax = axes[0]
    tl = auto.get("timeline", [])
    if tl:
        ts = [s["t"] for s in tl]
        ax.step(ts, [s["prefill"] for s in tl], where="post", label="prefill workers", color="tab:orange")
        ax.step(ts, [s["decode"] for s in tl], where="post", label="decode workers", color="tab:blue")
        ax2 = ax.twinx()
        for pool, color in (("prefill", "tab:orange"), ("decode", "tab:blue")):
            ax2.plot(ts, [min(s["pressure"][pool], 5.0) for s in tl], color=color, alpha=0.35, lw=1,
                     label=f"{pool} pressure (capped at 5)")
        ax2.axhline(1.0, color="grey", ls=":", lw=1)
        ax2.set_ylabel("pressure (1 = at the objective)")
        ax2.legend(loc="upper right", fontsize=8)
    for a in auto.get("actions", []):
        ax.axvline(a["started"], color="tab:red", lw=1)
        what = (f"{a['worker']} -> {a['to']}" if a["action"] == "role" else
                f"stop {a['worker']}" if a["action"] == "stop" else f"start {a['worker']} ({a['to']})")
        ax.text(a["started"], 2.15, f"{what}, {a['seconds']:.0f} s",
                rotation=90, fontsize=7, va="top", ha="right", color="tab:red")
    for axx in axes[:2]:
        axx.axvspan(0, half, color="tab:blue", alpha=0.05)
        axx.axvspan(half, 2 * half, color="tab:orange", alpha=0.05)
        axx.set_xlim(0, 2 * half)
    ax.set_ylim(-0.1, 2.3)
    ax.set_ylabel("workers")
    ax.set_title("autoscaled: layout and role changes (decode-heavy half, then prefill-heavy)")
    ax.legend(loc="upper left", fontsize=8)
    ax = axes[1]
    width = max(10.0, half / 6)
    for name, style in (("autoscaled", "-"), (best, "--")):
        reqs = configs.get(name or "", {}).get("requests", [])
        if not reqs:
            continue
        edges = [i * width for i in range(int(2 * half / width) + 1)]
        xs, ys = [], []
        for lo in edges[:-1]:
            sel = [r["met"] for r in reqs if lo <= r["t"] < lo + width]
            if sel:
                xs.append(lo + width / 2)
                ys.append(sum(sel) / len(sel))
        ax.plot(xs, ys, style, marker="o", ms=3, label=name)
    ax.set_ylabel(f"attainment ({width:.0f} s bins)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("seconds since the workload's start")
    ax.legend(fontsize=8)
    ax = axes[2]
    names = [n for n in configs if "whole" in configs[n]]
    xs = range(len(names))
    halves = list(configs[names[0]]["phases"]) if names else []   # in the run's order
    bars = [("whole", "whole run")] + [(h, f"{h.replace('_', '-')} half") for h in halves]
    for k, (key, label) in enumerate(bars):
        vals = [configs[n]["whole"]["goodput"] if key == "whole" else configs[n]["phases"][key]["goodput"]
                for n in names]
        ax.bar([x + (k - 1) * 0.27 for x in xs], vals, width=0.27, label=label)
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set_ylabel("goodput (req/s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
