"""``kvplan recommend`` on each of benchmarks.serving.compare's workloads, against the measured runs.

    python -m benchmarks.planner.recommend_check --runs results/fidelity/r1 results/fidelity/r2 results/fidelity/r3 \\
        --profile results/fidelity/profile_t1.json --profile results/fidelity/profile_t2.json

Checks the planner's recommendations against measured sweeps. For each part of the runs (mixed, mixed_quiet, trace,
multi_turn) the planner gets the workload compare gave its first configuration's sweep (the
run's recorded flags: workload, rates, point length, salts; objectives dropped, so the planner
derives them as compare does, from its first candidate's unloaded latency) and the budget of
this machine's compare: 2 CPUs, at most one colocated worker (what ``kvrouter up`` starts),
chunked prefill off or at 256 tokens, 512 device blocks in all, a 2 GB store. It searches that
space (``planner.candidates.candidates``: a colocated 2-thread worker without and with chunking,
1 prefill + 1 decode worker of one thread each) and ranks by goodput per device.

Every candidate is one of the configurations each compare run measured, one after another in
the same run (``CANDIDATE_RUNS``), so the rejected configurations ran beside the recommended
one. Each run scores a configuration as the planner does: the highest rate still keeping 90%
attainment (interpolated), then the attainment at the lowest rate. The verdict per part is
``ok`` when the recommendation is the best measured, or within noise of it
(``benchmarks.planner.sim_fidelity.verdict``, as for the simulator's own choices). Writes
``OUT/recommend_check.json`` and prints one JSON line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.planner.sim_fidelity import _argv, _measured, _strip_objectives, verdict
from benchmarks.report import emit
from benchmarks.serving.sweep import build_parser as sweep_parser
from planner.cli import build_parser as kvplan_parser
from planner.metrics import max_rate_meeting
from planner.recommend import run_recommend

# The budget of benchmarks.serving.compare's configurations, as kvplan recommend flags.
BUDGET = ["--devices", "2", "--threads-per-worker", "1", "--max-colocated", "1", "--chunks", "0,256",
          "--num-blocks", "512", "--store-memory", "2G"]
# kvplan recommend's candidate -> the compare configuration that ran it.
CANDIDATE_RUNS = {"colo1x2t_nochunk": "colo_nochunk", "colo1x2t_chunk256": "colo_chunk",
                  "split1p1d_chunk256": "disagg_store"}
PARTS = ("mixed", "mixed_quiet", "trace", "multi_turn")
_NOT_WORKLOAD = {"config", "out", "no_progress", "profile"}


def recommend_args(sweep_argv: list[str], profiles: list[str]) -> argparse.Namespace:
    """``kvplan recommend``'s arguments: the budget, the profiles, and the sweep's workload."""
    args = kvplan_parser().parse_args(
        ["recommend", *BUDGET, "--no-progress", *(a for p in profiles for a in ("--profile", p))])
    sweep = sweep_parser().parse_args(_strip_objectives(sweep_argv))
    for key, value in vars(sweep).items():
        if key not in _NOT_WORKLOAD and hasattr(args, key):
            setattr(args, key, value)
    return args


def score(points: list[dict[str, Any]]) -> tuple[float, float]:
    """One run's score of one configuration, ordered as the planner ranks."""
    rate = max_rate_meeting(points)["interpolated"] or 0.0
    return rate, points[0]["summary"]["attainment"] if points else 0.0


def check(runs: list[Path], profiles: list[str], parts: list[str]) -> dict[str, Any]:
    out = []
    for part in parts:
        argv = _argv(runs, "colo_nochunk", part)
        if argv is None:
            continue
        rec = run_recommend(recommend_args(argv, profiles))
        name = str(rec["best"]["name"])
        chosen = CANDIDATE_RUNS.get(name, name)
        measured = {cfg: [score(pts) for pts in _measured(runs, cfg, part)] for cfg in CANDIDATE_RUNS.values()}
        measured = {c: s for c, s in measured.items() if s}
        row = {"part": part, "recommended": name, "runs_as": chosen,
               "runner_up": rec["runner_up"]["name"] if rec["runner_up"] else None,
               "planner_says": rec["verdict"], "command": rec["best"]["command"],
               "simulated": {CANDIDATE_RUNS.get(r["name"], r["name"]): r["capacity_rps"] for r in rec["ranked"]},
               "measured": measured, **verdict(chosen, measured)}
        print(f"[recommend_check] {part}: recommends {chosen}, measured best {row['measured_best']}: "
              f"{row['verdict']}", file=sys.stderr)
        out.append(row)
    return {"bench": "recommend_check", "runs": [str(r) for r in runs], "budget": " ".join(BUDGET),
            "parts": out, "ok": f"{sum(r['verdict'] == 'ok' for r in out)}/{len(out)}"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner.recommend_check",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--runs", nargs="+", required=True, help="benchmarks.serving.compare output directories")
    p.add_argument("--profile", action="append", required=True,
                   help="kvengine profile files (per thread count), as kvplan takes them")
    p.add_argument("--parts", default=",".join(PARTS), help="part labels (default %(default)s)")
    p.add_argument("--out", default="results/recommend_check", help="output directory (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rec = check([Path(r) for r in args.runs], args.profile, args.parts.split(","))
    emit(rec, Path(args.out) / "recommend_check.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
