"""``kvplan``: simulate serving configurations from a profile, and recommend one.

    kvplan simulate --profile profile.json --config split="--prefill 1 --decode 1" \\
        --config colo="--mode colocated --threads-per-worker 2" --workload trace --rates 0.1,0.3,0.5
    kvplan recommend --profile profile.json --workers 2 --workload mixed --rates 0.2,0.4,0.6

``simulate`` runs ``planner.sim.sweep`` (the sweep's points and objectives, simulated) for each
``--config NAME="kvrouter up flags"`` and prints one JSON line in the shape of
``benchmarks.serving.sweep``'s record; ``--out DIR`` also writes ``simulate.json`` and the sweep's
plots (latency and goodput against rate, attainment against SLO scale). The workload flags are
the load generator's (``planner.workload_args``), the others ``planner.sweep_args``.
``recommend``: ``planner.recommend``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from planner.metrics import SLO_SCALES, summary_stat
from planner.sim.config import from_up_flags
from planner.sim.run import Profiles
from planner.sim.sweep import simulate_sweep
from planner.sweep_args import add_objective_args, settings_from_args

__all__ = ["build_parser", "main"]


def brief(rec: dict[str, Any]) -> dict[str, Any]:
    """A configuration's curve, as ``benchmarks.serving.sweep`` prints it."""
    def point(s: dict[str, Any]) -> dict[str, Any]:
        return {"ttft_p50": summary_stat(s, "ttft_s", "p50"), "ttft_p90": summary_stat(s, "ttft_s", "p90"),
                "tpot_p50": summary_stat(s, "tpot_s", "p50"), "tpot_p90": summary_stat(s, "tpot_s", "p90"),
                "goodput": s["goodput"], "attainment": s["attainment"], "issued": s["issued"], "failed": s["failed"]}

    return {k: v for k, v in rec.items() if k != "points"} | {
        "curve": [{"rate": p["rate"], **point(p["summary"])} for p in rec["points"]]}


def plot(results: dict[str, dict[str, Any]], out: Path, title: str) -> None:
    from planner.plots import plot_attainment_vs_slo_scale, plot_goodput_vs_rate, plot_latency_vs_rate

    curves = {name: r["points"] for name, r in results.items()}
    slos = {name: (r["slo"]["ttft_s"], r["slo"]["tpot_s"]) for name, r in results.items()}
    plot_latency_vs_rate(curves, out / "latency_vs_rate.png", title, slos)
    plot_goodput_vs_rate(curves, out / "goodput_vs_rate.png", title)
    mid = {name: pts[len(pts) // 2] for name, pts in curves.items()}
    plot_attainment_vs_slo_scale({n: (p["rate"], SLO_SCALES, p["attainment_at_scale"]) for n, p in mid.items()},
                                 out / "goodput_vs_slo_scale.png", title)


def _simulate(args: argparse.Namespace) -> dict[str, Any]:
    if not args.config:
        raise ValueError('give at least one --config NAME="kvrouter up flags"')
    profiles = Profiles.from_files(args.profile)
    configs = []
    for spec in args.config:
        name, sep, flags = spec.partition("=")
        if not sep or not name:
            raise ValueError(f'--config wants NAME="kvrouter up flags", got {spec!r}')
        configs.append(from_up_flags(name, flags, salt_per_request=args.salt_per_request,
                                     max_model_len=args.max_context))
    t0 = time.perf_counter()
    progress = None if args.no_progress else (lambda rec: print(
        f"[kvplan] {rec['config']} @ {rec['rate']:g} req/s: goodput {rec['summary']['goodput']:.3f} req/s, "
        f"attainment {rec['summary']['attainment']:.0%}", file=sys.stderr))
    results = simulate_sweep(configs, profiles, args, settings_from_args(args), progress)
    record = {"bench": "kvplan-simulate", "simulated": True, "profiles": profiles.describe(),
              "profile_files": args.profile, "workload": args.workload, "rates": sorted(settings_from_args(args).rates),
              "point_seconds": args.point_seconds, "seconds": time.perf_counter() - t0,
              "configs": {n: brief(r) for n, r in results.items()}}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "simulate.json").write_text(json.dumps({**record, "full": results}, indent=1))
        plot(dict(results), out, f"simulated: {args.workload} ({'; '.join(profiles.describe())})")
    return record


def build_parser() -> argparse.ArgumentParser:
    from kvstore.version import installed_version

    p = argparse.ArgumentParser(prog="kvplan", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("simulate", help="simulate configurations on a workload from a profile",
                       description="Simulate each --config on the workload at each rate (planner.sim).")
    s.add_argument("--config", action="append", default=[], metavar='NAME="FLAGS"',
                   help='a configuration as `kvrouter up` flags, e.g. split="--prefill 1 --decode 1"; repeatable')
    s.add_argument("--no-progress", action="store_true", help="no per-point lines on stderr")
    add_objective_args(s)
    from planner.recommend import add_recommend_parser

    add_recommend_parser(sub)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "simulate":
            record = _simulate(args)
        else:
            from planner.recommend import run_recommend

            record = run_recommend(args)
    except (ValueError, OSError, RuntimeError) as e:
        sys.exit(f"kvplan {args.command}: {e}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
