"""The simulator against the real thing: ``kvplan``'s predictions beside repeated compare runs.

    python -m benchmarks.planner.sim_fidelity --runs results/fidelity/r1 results/fidelity/r2 results/fidelity/r3 \\
        --profile results/fidelity/profile_cpu_t1.json --profile results/fidelity/profile_cpu_t2.json \\
        --out results/fidelity/report

Each run is a ``benchmarks.serving.compare`` output directory (the same parts, configurations and
rates in every run). The simulator is calibrated from the profiles alone (``kvengine
profile``, with the serving section ``benchmarks.planner.stack_profile`` adds from requests of its
own, measured before the runs, never fitted to them; ``--engine-only`` drops that section).
With ``--profiles-in-runs``, each run
is simulated with the profiles taken just before it (files in its own directory), and a point's
prediction is the median of the runs' simulations: the test of whether drift between one
profile and an hour of runs is what limits the simulator (here it did worse: docs/benchmarks.md).
For every configuration and part
it simulates the very sweep compare ran (the sweep's own flags, read back from each part's
``argv``: workload, rates, point length, salts, pre-warm), with objectives set as compare sets
them: from the first configuration's unloaded latency, here simulated. Then, per point,
p50 and p90 TTFT and TPOT: simulated against the repeats' median, and the verdict

- ``ok``: within 15% of the median, or inside the repeats' min-max (when the machine's own
  spread is wider than 15%);
- ``off``: neither.

And per configuration and part: the highest rate that keeps 90% attainment (``max_rate_90``,
as tested), simulated against measured, ``ok`` within one rate step of the repeats' median.
And per part, the planner's question: is the configuration the simulator ranks first the
best measured, or within noise of it?
Writes ``OUT/fidelity.json``, ``OUT/fidelity.md`` (the table) and ``OUT/fidelity.png``
(simulated against measured, the 15% band), and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.report import emit, pyplot, save_figure, write_json
from benchmarks.serving import compare
from benchmarks.serving.sweep import build_parser as sweep_parser
from engine.profile.format import load
from planner.metrics import Slo, max_rate_meeting, summary_stat
from planner.sim.config import from_up_flags
from planner.sim.run import Profiles
from planner.sim.sweep import SweepSettings, simulate_config

METRICS = (("ttft_s", "p50"), ("ttft_s", "p90"), ("tpot_s", "p50"), ("tpot_s", "p90"))
TOLERANCE = 0.15


def _measured(runs: list[Path], name: str, label: str) -> list[list[dict[str, Any]]]:
    """Each run's sweep points of ``name``/``label`` (empty runs skipped)."""
    out = []
    for run in runs:
        path = run / name / label / "sweep.jsonl"
        if path.is_file():
            pts = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            out.append([p for p in pts if p.get("config") == name])
    return [pts for pts in out if pts]


def _argv(runs: list[Path], name: str, label: str) -> list[str] | None:
    for run in runs:
        rec = json.loads((run / "compare.json").read_text())
        part = rec["configs"].get(name, {}).get("parts", {}).get(label)
        if part and part.get("argv"):
            return shlex.split(part["argv"])[3:]
    return None


def _strip_objectives(argv: list[str]) -> list[str]:
    """The sweep's flags without the objectives compare fixed from its first configuration."""
    fixed = {"--ttft-slo-ms", "--tpot-slo-ms", "--ttft-slo-per-token-ms", "--ttft-slo-ref-tokens"}
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in fixed:
            skip = True
            continue
        out.append(a)
    return out


def judge(sim: float | None, measured: list[float]) -> dict[str, Any]:
    if sim is None or not measured:
        return {"sim": sim, "verdict": "n/a"}
    med = statistics.median(measured)
    lo, hi = min(measured), max(measured)
    err = (sim - med) / med if med else 0.0
    ok = abs(err) <= TOLERANCE or lo <= sim <= hi
    return {"sim": sim, "median": med, "min": lo, "max": hi, "error": err,
            "spread": (hi - lo) / med if med else 0.0, "verdict": "ok" if ok else "off"}


def _rate_step(rates: list[float]) -> float:
    steps = [b - a for a, b in zip(rates, rates[1:])]
    return min(steps) if steps else 0.0


def combine(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One simulated sweep from several (one per run's own profiles): per point, each latency
    percentile the median of theirs; the 90% rates the median of theirs (the lower middle one
    when even, so a rate stays a tested rate); the objectives and unloaded latency the first's."""
    if len(recs) == 1:
        return recs[0]

    def middle(xs: list[float | None]) -> float | None:
        ranked = sorted(xs, key=lambda x: -1.0 if x is None else x)   # none (not even the lowest) first
        return ranked[(len(ranked) - 1) // 2]

    points = []
    for i, p in enumerate(recs[0]["points"]):
        summary: dict[str, Any] = {}
        for metric in {m for m, _ in METRICS}:
            quants = [r["points"][i]["summary"].get(metric) for r in recs]
            summary[metric] = (None if any(q is None for q in quants) else
                               {q: statistics.median(d[q] for d in quants) for q in quants[0]})
        summary["attainment"] = statistics.median(r["points"][i]["summary"]["attainment"] for r in recs)
        points.append({"rate": p["rate"], "summary": summary})
    rates = {k: middle([r["max_rate_90"][k] for r in recs]) for k in ("tested", "interpolated")}
    return {**recs[0], "points": points, "max_rate_90": rates}


def fidelity(runs: list[Path], profiles: list[Profiles], labels: list[str]) -> dict[str, Any]:
    """``profiles``: one set for every run, or one per run (in ``runs``' order)."""
    parts = {label: part for part, label, _ in compare.parts(False)}
    rows: list[dict[str, Any]] = []
    rates_rows: list[dict[str, Any]] = []
    for label in labels:
        sim_slos: list[Slo | None] = [None] * len(profiles)
        for name, spec in compare.CONFIGS.items():
            suffixes = [""] + (["_salted"] if label == "trace" and name == "colo_chunk" else [])
            for suffix in suffixes:
                key = label + suffix
                argv = _argv(runs, name, key)
                measured = _measured(runs, name, key)
                if argv is None or not measured:
                    continue
                args = sweep_parser().parse_args(_strip_objectives(argv))
                salt = bool(args.salt_per_request)
                cfg = from_up_flags(name, f"{spec['up']} --store-memory 2G", salt_per_request=salt,
                                    max_model_len=args.max_context)
                rates = sorted(float(r) for r in args.rates.split(","))
                t0 = time.perf_counter()
                recs = []
                for i, prof in enumerate(profiles):
                    s = SweepSettings(tuple(rates), args.point_seconds, args.unloaded_samples,
                                      args.ttft_slo_mult, args.tpot_slo_mult, args.ttft_slo_per_length,
                                      "own", sim_slos[i], args.prewarm_concurrency)
                    recs.append(simulate_config(cfg, prof, args, s))
                    if sim_slos[i] is None:
                        sim_slos[i] = Slo(**recs[-1]["slo"])
                rec = combine(recs)
                for p_sim in rec["points"]:
                    rate = p_sim["rate"]
                    reps = [next((p for p in pts if p["rate"] == rate), None) for pts in measured]
                    reps = [p for p in reps if p is not None]
                    for metric, q in METRICS:
                        vals = [v for v in (summary_stat(p["summary"], metric, q) for p in reps) if v is not None]
                        rows.append({"config": name, "part": key, "rate": rate, "metric": f"{metric[:4]}_{q}",
                                     "repeats": len(vals), **judge(summary_stat(p_sim["summary"], metric, q), vals)})
                sim_rate = rec["max_rate_90"]["tested"]
                meas_rates = [max_rate_meeting(pts)["tested"] for pts in measured]
                meas_interp = [max_rate_meeting(pts)["interpolated"] for pts in measured]
                known = [r if r is not None else 0.0 for r in meas_rates]
                med = statistics.median(known)
                step = _rate_step(rates)
                rates_rows.append({
                    "config": name, "part": key, "rates": rates, "sim": sim_rate, "measured": meas_rates,
                    "sim_interpolated": rec["max_rate_90"]["interpolated"], "measured_interpolated": meas_interp,
                    "median": med, "verdict": "ok" if abs((sim_rate or 0.0) - med) <= step + 1e-9 else "off",
                    "sim_seconds": time.perf_counter() - t0, "sim_slo": rec["slo"],
                    "measured_slo": measured[0][0].get("slo"),
                    "sim_unloaded": rec["unloaded"], "measured_unloaded": measured[0][0].get("unloaded")})
                print(f"[fidelity] {name} {key}: simulated in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    choices = _choices(rates_rows)
    ok = [r for r in rows if r["verdict"] == "ok"]
    judged = [r for r in rows if r["verdict"] != "n/a"]
    return {"bench": "sim_fidelity", "runs": [str(r) for r in runs], "profiles": [p.describe() for p in profiles],
            "tolerance": TOLERANCE, "points": rows, "max_rate_90": rates_rows,
            "points_ok": f"{len(ok)}/{len(judged)}",
            "rates_ok": f"{sum(r['verdict'] == 'ok' for r in rates_rows)}/{len(rates_rows)}",
            "choices": choices,
            "median_abs_error": statistics.median(abs(r["error"]) for r in judged) if judged else None,
            "parts": parts}


def verdict(chosen: str, measured: dict[str, list[tuple[float, ...]]]) -> dict[str, Any]:
    """The measured best configuration (the highest medians of its runs' scores, which compare
    as tuples) and the verdict on ``chosen``: ``ok`` when it is the best or within noise of it
    (not every run of the best beats every run of ``chosen``)."""
    def medians(c: str) -> tuple[float, ...]:
        return tuple(statistics.median(s[i] for s in measured[c]) for i in range(len(measured[c][0])))

    best = max(measured, key=medians)
    beaten = best != chosen and all(b > c for b in measured[best] for c in measured.get(chosen, []))
    return {"measured_best": best, "verdict": "off" if beaten or chosen not in measured else "ok"}


def _choices(rates_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per part: the configuration the simulator ranks first (the highest interpolated rate at
    90% attainment; ties keep compare's order) against the measured best (the highest median
    over the runs), judged by ``verdict``."""
    out = []
    for part in sorted({r["part"].removesuffix("_salted") for r in rates_rows}):
        rows = [r for r in rates_rows if r["part"] == part]
        if len(rows) < 2:
            continue
        sim_best = max(rows, key=lambda r: r["sim_interpolated"] or 0.0)
        meas = {r["config"]: [x or 0.0 for x in r["measured_interpolated"]] for r in rows}
        v = verdict(sim_best["config"], {c: [(x,) for x in xs] for c, xs in meas.items()})
        out.append({"part": part, "simulated_best": sim_best["config"], "measured_best": v["measured_best"],
                    "measured": meas, "simulated": {r["config"]: r["sim_interpolated"] for r in rows},
                    "verdict": v["verdict"]})
    return out


def table(rec: dict[str, Any]) -> str:
    lines = ["| configuration | part | rate | metric | measured median [min-max] | simulated | error | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rec["points"]:
        if r["verdict"] == "n/a":
            continue
        lines.append(f"| {r['config']} | {r['part']} | {r['rate']:g} | {r['metric']} | "
                     f"{r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}] | {r['sim']:.3f} | "
                     f"{r['error']:+.0%} | {r['verdict']} |")
    lines += ["", "| configuration | part | rates | max_rate_90 measured (each run) | simulated | verdict |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in rec["max_rate_90"]:
        lines.append(f"| {r['config']} | {r['part']} | {','.join(f'{x:g}' for x in r['rates'])} | "
                     f"{', '.join('none' if m is None else f'{m:g}' for m in r['measured'])} | "
                     f"{'none' if r['sim'] is None else format(r['sim'], 'g')} | {r['verdict']} |")
    lines += ["", "| part | the simulator's choice | measured best | "
              "90% rate per configuration, measured (each run) | verdict |",
              "| --- | --- | --- | --- | --- |"]
    for c in rec.get("choices", []):
        meas = "; ".join(f"{k}: {', '.join(f'{x:.2g}' for x in v)}" for k, v in c["measured"].items())
        lines.append(f"| {c['part']} | {c['simulated_best']} | {c['measured_best']} | {meas} | {c['verdict']} |")
    return "\n".join(lines) + "\n"


def plot(rec: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, metric in zip(axes, ("ttft", "tpot")):
        pts = [r for r in rec["points"] if r["metric"].startswith(metric) and r["verdict"] != "n/a"]
        for verdict, colour in (("ok", "tab:green"), ("off", "tab:red")):
            sel = [r for r in pts if r["verdict"] == verdict]
            ax.errorbar([r["median"] for r in sel], [r["sim"] for r in sel],
                        xerr=[[r["median"] - r["min"] for r in sel], [r["max"] - r["median"] for r in sel]],
                        fmt="o", color=colour, label=f"{verdict} ({len(sel)})", alpha=0.7)
        if pts:
            lo = min(min(r["min"], r["sim"]) for r in pts) * 0.8
            hi = max(max(r["max"], r["sim"]) for r in pts) * 1.25
            xs = [lo, hi]
            ax.plot(xs, xs, "k-", lw=0.8)
            ax.fill_between(xs, [x * (1 - TOLERANCE) for x in xs], [x * (1 + TOLERANCE) for x in xs],
                            color="grey", alpha=0.2, label="within 15%")
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel(f"measured {metric.upper()} (s, median of repeats; bars: min-max)")
        ax.set_ylabel(f"simulated {metric.upper()} (s)")
        ax.set_title(f"{metric.upper()} p50 and p90, every configuration, part and rate")
        ax.legend(fontsize=8)
    fig.suptitle(f"kvplan simulate vs {len(rec['runs'])} measured compare runs: points {rec['points_ok']} ok, "
                 f"90%-goodput rates {rec['rates_ok']} ok", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner.sim_fidelity",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--runs", nargs="+", required=True, help="benchmarks.serving.compare output directories (>= 3)")
    p.add_argument("--profile", action="append", default=[], help="kvengine profile files (per thread count)")
    p.add_argument("--profiles-in-runs", nargs="+", default=None, metavar="NAME",
                   help="instead of --profile: each run's own profiles, these file names in its directory "
                        "(taken just before it); a point's prediction is the median of the runs' simulations")
    p.add_argument("--parts", default="mixed,mixed_quiet,trace,multi_turn", help="part labels (default %(default)s)")
    p.add_argument("--out", default="results/fidelity/report", help="directory for the report (default %(default)s)")
    p.add_argument("--engine-only", action="store_true",
                   help="ignore the profiles' serving sections (benchmarks.planner.stack_profile): the engine alone")
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    runs = [Path(r) for r in args.runs]
    if bool(args.profile) == bool(args.profiles_in_runs):
        parser.error("give --profile (one set for every run) or --profiles-in-runs (each run's own), not both")
    sets = [[run / name for name in args.profiles_in_runs] for run in runs] if args.profiles_in_runs else [args.profile]
    profiles = [Profiles([(load(path).engine_only() if args.engine_only else load(path)) for path in paths])
                for paths in sets]
    rec = fidelity(runs, profiles, args.parts.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "fidelity.json", rec)
    (out / "fidelity.md").write_text(table(rec))
    plot(rec, out / "fidelity.png")
    emit({k: v for k, v in rec.items() if k not in ("points",)})


if __name__ == "__main__":
    main()
