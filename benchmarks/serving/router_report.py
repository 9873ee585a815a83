"""router_bench's report: the targets' verdict, the plot, and the median of several runs.

The router's targets are judged in the median of 3 runs; one command runs them and reports it::

    .venv/bin/python -m benchmarks.serving.router_report --runs 3 --save /tmp/rb -- --peer dynamo --out /tmp/rb

runs ``python -m benchmarks.serving.router_bench`` (with the arguments after ``--``) that many times,
one after another, keeps each run's JSON line (``--save DIR``: ``run1.json``...), and prints
one JSON line: per cell the median over runs of every latency and of every run's ratio to
Dynamo (each run's ours and Dynamo's share that run's machine), the targets judged on those
medians, and each run's own verdict; a markdown table of it goes to stderr. ``--from A B C``
reports saved runs instead of running.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np

from benchmarks import lifecycle
from benchmarks.report import emit, pyplot, save_figure

__all__ = ["TARGET_P99_MS", "TARGET_LOOKUP_VS_DYNAMO", "TARGET_DECISION_P99_VS_DYNAMO",
           "targets", "plot_cells", "median_cells", "table"]

TARGET_P99_MS = 1.0
TARGET_LOOKUP_VS_DYNAMO, TARGET_DECISION_P99_VS_DYNAMO = 1.0, 1.25
_PCTS = ("p50", "p99")


def targets(cells: list[dict], peer: bool) -> dict:
    """The verdict over ``cells``: every decision's p99 under 1 ms; with Dynamo, every cell's
    lookup at or below ``find_matches`` at p50 and p99 (ratio <= 1.0) and its decision within
    1.25x of it at p99, and no query whose match differs from Dynamo's."""
    p99_max = max(c["ours"]["decision_us"]["p99"] for c in cells) / 1e3
    out = {"decision_p99_ms_max": round(p99_max, 4), "p99_under_1ms": p99_max < TARGET_P99_MS}
    if peer:
        ratios = [c["ratio_vs_dynamo"] for c in cells]
        out["decision_vs_dynamo_max"] = {p: max(r[f"decision_{p}"] for r in ratios) for p in ("p50", "p99")}
        out["lookup_vs_dynamo_max"] = {p: max(r[f"lookup_{p}"] for r in ratios) for p in ("p50", "p99")}
        out["lookup_at_or_below_dynamo"] = max(out["lookup_vs_dynamo_max"].values()) <= TARGET_LOOKUP_VS_DYNAMO
        out["decision_p99_within_1_25x_of_dynamo"] = (
            out["decision_vs_dynamo_max"]["p99"] <= TARGET_DECISION_P99_VS_DYNAMO)
        out["dynamo_mismatches"] = sum(c["dynamo_mismatches"] for c in cells)
    return out


def _med(values: list[float]) -> float:
    return round(float(np.median(values)), 2)


def median_cells(runs: list[dict]) -> list[dict]:
    """Cells in router_bench's shape, each figure the median over ``runs`` of that figure."""
    out = []
    for cells in zip(*(r["cells"] for r in runs)):
        c0 = cells[0]
        assert all((c["index_blocks"], c["prompt_tokens"]) == (c0["index_blocks"], c0["prompt_tokens"])
                   for c in cells), "the runs do not have the same cells"
        cell = {"index_blocks": c0["index_blocks"], "prompt_tokens": c0["prompt_tokens"],
                "runs": len(cells),
                "ours": {w: {p: _med([c["ours"][w][p] for c in cells]) for p in _PCTS}
                         for w in ("lookup_us", "decision_us")}}
        if "dynamo" in c0:
            cell["dynamo"] = {"find_matches_us": {
                p: _med([c["dynamo"]["find_matches_us"][p] for c in cells]) for p in _PCTS}}
            cell["ratio_vs_dynamo"] = {k: _med([c["ratio_vs_dynamo"][k] for c in cells])
                                       for k in c0["ratio_vs_dynamo"]}
            cell["dynamo_mismatches"] = sum(c["dynamo_mismatches"] for c in cells)
        out.append(cell)
    return out


def table(cells: list[dict]) -> str:
    """A markdown table of (median) cells."""
    peer = "dynamo" in cells[0]
    head = ["index blocks", "prompt", "lookup p50", "lookup p99", "decision p50", "decision p99"]
    if peer:
        head += ["Dynamo p50", "Dynamo p99", "lookup/D p50", "lookup/D p99", "decision/D p50",
                 "decision/D p99"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in cells:
        o = c["ours"]
        row = [f"{c['index_blocks']:,}", str(c["prompt_tokens"]),
               *(f"{o[w][p]:.2f}" for w in ("lookup_us", "decision_us") for p in _PCTS)]
        if peer:
            d, r = c["dynamo"]["find_matches_us"], c["ratio_vs_dynamo"]
            row += [f"{d['p50']:.2f}", f"{d['p99']:.2f}",
                    *(f"{r[f'{w}_{p}']:.2f}" for w in ("lookup", "decision") for p in _PCTS)]
        rows.append("| " + " | ".join(row) + " |")
    return "\n".join(rows)


def plot_cells(cells: list[dict], path: Path, peer: bool, block: int = 16, workers: int = 8) -> None:
    """router_bench.png: per prompt length, each series' p50 and p99 against the index size."""
    plt = pyplot()

    lengths = sorted({c["prompt_tokens"] for c in cells})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.6 * len(lengths), 4), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        row = sorted((c for c in cells if c["prompt_tokens"] == length), key=lambda c: c["index_blocks"])
        xs = [c["index_blocks"] for c in row]
        series = [("decision", lambda c, p: c["ours"]["decision_us"][p], "C0", "o"),
                  ("lookup", lambda c, p: c["ours"]["lookup_us"][p], "C2", "^")]
        if peer:
            series.append(("Dynamo find_matches", lambda c, p: c["dynamo"]["find_matches_us"][p], "C3", "s"))
        for label, get, color, marker in series:
            for p, style in (("p50", "-"), ("p99", "--")):
                ax.plot(xs, [get(c, p) for c in row], style, color=color, marker=marker,
                        label=f"{label} {p}")
        ax.axhline(TARGET_P99_MS * 1e3, color="grey", linestyle=":", label="1 ms target")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("index size asked for (distinct blocks)")
        ax.set_ylabel("µs per call")
        ax.set_title(f"{length}-token prompts ({length // block} keys)")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"router_bench: routing decision cost, {workers} workers "
                 f"({os.cpu_count()} CPUs, {platform.machine()})", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving.router_report",
                                 description=(__doc__ or "").split("\n")[0],
                                 epilog="Arguments after -- go to every router_bench run.")
    ap.add_argument("--runs", type=int, default=3, help="router_bench runs (default %(default)s)")
    ap.add_argument("--save", type=Path, help="directory for each run's JSON line (runN.json)")
    ap.add_argument("--from", dest="saved", type=Path, nargs="+", help="report these saved runs")
    return ap


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    args = build_parser().parse_args(own)
    if args.saved:
        runs = [json.loads(p.read_text()) for p in args.saved]
    else:
        runs = []
        for i in range(args.runs):
            r = lifecycle.run([sys.executable, "-m", "benchmarks.serving.router_bench", *bench_args])
            if r.returncode != 0:
                raise SystemExit(f"router_bench run {i + 1} failed ({r.returncode}): {r.stderr[-2000:]}")
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
            if args.save:
                args.save.mkdir(parents=True, exist_ok=True)
                (args.save / f"run{i + 1}.json").write_text(r.stdout)
            print(f"router_report: run {i + 1}/{args.runs} done", file=sys.stderr)
    cells = median_cells(runs)
    peer = "dynamo" in cells[0]
    print(table(cells), file=sys.stderr)
    emit({"bench": "router_median", "runs": len(runs), "args": bench_args,
                      "index_table": runs[0].get("index_table"), "peer": runs[0].get("peer"),
                      "cells": cells, "target": targets(cells, peer),
                      "run_targets": [r["target"] for r in runs]})


if __name__ == "__main__":
    sys.exit(lifecycle.run_main(main))
