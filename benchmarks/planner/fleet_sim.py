"""Simulated GPU fleets on the Mooncake trace: what ``kvplan recommend`` says for 8 to 64 GPUs.
**A simulation**: no GPU ran; step times come from a GPU profile built from published
measurements (``planner/profiles``), named in every record.

    python -m benchmarks.planner.fleet_sim --sizes 8,16,32,64 --out results/fleet_sim

For each fleet size N: ``kvplan recommend --devices N --profile PROFILE --workload trace
--trace-count 3000`` (``planner.recommend``: candidates that are GPUs, each one's capacity by a
bounded rate search, per-length TTFT and a fixed TPOT objective, GPU-seconds and KV bytes), with
any further ``kvplan recommend`` flags given after ``--``. Sizes run ``--jobs`` at a time, each
in its own process. Writes ``OUT/fleet_sim.json`` (each size's whole record), ``OUT/table.md``
(one row a size: the recommendation, its capacity, the GPU-seconds ratio, the runner-up and
the margin) and ``OUT/fleet_capacity.png`` (capacity per GPU against fleet size, colocated
and the best split), and prints one JSON line.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.lifecycle import REPO
from benchmarks.report import emit, machine_info, pyplot, save_figure, write_json

DEFAULT_PROFILE = REPO / "planner" / "profiles" / "a100_vidur_llama3_8b.json"


def recommend_argv(n: int, ns: argparse.Namespace) -> list[str]:
    return ["recommend", "--devices", str(n), "--profile", ns.profile, "--workload", "trace",
            "--trace-count", str(ns.trace_count), "--no-progress", *ns.extra]


def run_size(n: int, ns: argparse.Namespace) -> dict[str, Any]:
    from planner.cli import build_parser
    from planner.recommend import run_recommend

    t0 = time.perf_counter()
    rec = run_recommend(build_parser().parse_args(recommend_argv(n, ns)))
    print(f"[fleet_sim] {n} GPUs: {rec['verdict']} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return rec


def table(sizes: list[dict[str, Any]]) -> str:
    rows = ["| GPUs | recommended | capacity, req/s (per GPU) | GPU-seconds P:D (prefill share; with reuse) "
            "| best split | runner-up, margin per GPU |",
            "| --- | --- | --- | --- | --- | --- |"]
    for r in sizes:
        b, ru, gs = r["best"], r["runner_up"], r["gpu_seconds"]
        split = next((x for x in r["ranked"] if x["mode"] != "colocated"), None)
        cap = f"{b['capacity_rps']:.3g} ({b['capacity_per_device']:.3g}), +{(b['uncertainty'] or 0):.0%}"
        runner = "none" if ru is None else (f"{ru['label']}: equivalent ({-ru['gap']:+.0%})" if ru["equivalent"]
                                            else f"{ru['label']}: {ru['gap']:.0%} lower")
        rows.append(f"| {r['devices']} | {b['label']} | {cap} | {gs['ratio']:.1f}:1 ({gs['prefill_share']:.0%}; "
                    f"{gs['prefill_share_reused']:.0%}) | "
                    + (f"{split['label']}: {split['capacity_rps']:.3g} ({split['capacity_per_device']:.3g})" if split
                       else "none") + f" | {runner} |")
    return "\n".join(rows) + "\n"


def plot(sizes: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ns = [r["devices"] for r in sizes]
    colo = [max((x["capacity_per_device"] for x in r["ranked"] if x["mode"] == "colocated"), default=0) for r in sizes]
    split = [max((x["capacity_per_device"] for x in r["ranked"] if x["mode"] != "colocated"), default=0)
             for r in sizes]
    ax.plot(ns, colo, "s--", label="colocated (best chunk)")
    ax.plot(ns, split, "o-", label="best prefill:decode split")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("GPUs")
    ax.set_ylabel("capacity per GPU (req/s at 90% attainment)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner.fleet_sim",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--profile", default=str(DEFAULT_PROFILE), help="a GPU profile (default: %(default)s)")
    p.add_argument("--sizes", default="8,16,32,64", help="fleet sizes in GPUs (default %(default)s)")
    p.add_argument("--trace-count", type=int, default=3000, help="requests of the trace's window (default 3000)")
    p.add_argument("--jobs", type=int, default=2, help="sizes simulated at once, one process each (default 2)")
    p.add_argument("--out", default="results/fleet_sim", help="output directory (default %(default)s)")
    p.add_argument("extra", nargs="*", help="further `kvplan recommend` flags, after --")
    return p


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    out = Path(ns.out)
    sizes = [int(x) for x in ns.sizes.split(",")]
    t0 = time.perf_counter()
    if ns.jobs > 1:
        with ProcessPoolExecutor(max_workers=ns.jobs) as pool:
            # the largest first, so the pool's last job is a short one
            futures = {n: pool.submit(run_size, n, ns) for n in sorted(sizes, reverse=True)}
            results = [futures[n].result() for n in sizes]
    else:
        results = [run_size(n, ns) for n in sizes]
    rec = {"bench": "fleet_sim", "simulated": True, "profile": ns.profile, "profiles": results[0]["profiles"],
           "commands": [" ".join(["kvplan", *recommend_argv(n, ns)]) for n in sizes],
           "seconds": time.perf_counter() - t0, "machine": machine_info(), "sizes": results}
    write_json(out / "fleet_sim.json", rec)
    (out / "table.md").write_text(table(results))
    plot(results, out / "fleet_capacity.png", f"SIMULATED: Mooncake trace ({ns.trace_count} requests, native scale)\n"
         f"on {results[0]['profiles'][0].split(' (')[0]}")
    emit({"bench": "fleet_sim", "simulated": True, "seconds": rec["seconds"],
          "sizes": [{"gpus": r["devices"], "verdict": r["verdict"]} for r in results]})


if __name__ == "__main__":
    main()
