"""Rate sweep: each configuration over a range of request rates, TTFT/TPOT/goodput plots.

    python -m benchmarks.serving.sweep --workload mixed --rates 0.5,1,2,4,8 --out results/sweep \\
        --config colocated=http://127.0.0.1:8000 \\
        --launch disagg="kvrouter up --mode disaggregated --prefill 1 --decode 1 --port 8001"

A configuration is an endpoint already running (``--config NAME=URL``) or a command the sweep
starts, waits for and stops with SIGTERM after its points (``--launch NAME=COMMAND``; the URL
is ``http://127.0.0.1:PORT`` with the command's ``--port``, 8000 if it has none; its output
goes to ``OUT/NAME.log``). A launched command must be the one answering: its port must be
free before it starts (else an earlier run's server would be measured), it must still run
once ``GET /v1/models`` answers, and a ``kvrouter up`` must also have printed its own "The
router is up at" line. A configuration that does not start is an error (``failed`` in the
results, exit status 1), never a measurement. SIGTERM or SIGINT stop what the sweep started
(``benchmarks.lifecycle``). Configurations run one after another, in the order given, so
each has the machine to itself.

Objectives are fixed before any load: at the start of each configuration, ``--unloaded-samples``
requests of the workload's typical shape are sent one at a time; the objectives are
``--ttft-slo-mult`` (5) x TTFT and ``--tpot-slo-mult`` (2) x TPOT of the first configuration
(``--slo-ref first``, the same objectives for all) or of each configuration (``own``), unless
``--ttft-slo-ms``/``--tpot-slo-ms`` fix them. Point ``i`` of every configuration uses seed
``1000 * seed + i``: the same prompts across configurations, fresh prompts across points (no
cache hits carried from one point to the next). A point sends for 3/4 of ``--point-seconds``
(120; ``--quick``: 30 and every other rate) and cancels what is left at the end of it.

Writes ``OUT/sweep.jsonl`` (one line per point), ``OUT/requests/NAME_rRATE.jsonl``,
``latency_vs_rate.png``, ``goodput_vs_rate.png``, ``goodput_vs_slo_scale.png``, and prints
one JSON line: per configuration its objectives, unloaded latency, curves and the highest rate
at which at least 90% of requests met both objectives.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import httpx

from benchmarks import lifecycle
from benchmarks.lifecycle import Configuration, Launched
from benchmarks.report import emit, machine_info
from benchmarks.serving.serve_bench import (
    add_bench_args,
    client_config,
    fetch_model,
    fixed_slo,
    measure_unloaded,
    pin_client,
    run_point,
    write_requests,
)
from planner.metrics import SLO_SCALES, Slo, Unloaded, attainment_at_scales, max_rate_meeting, summary_stat
from planner.workload_args import build_workload, spec_from_args
from planner.workloads import TokenSpace

__all__ = ["max_rate_meeting", "main"]


class _ConfigAction(argparse.Action):
    """``--config``/``--launch NAME=VALUE`` into one ordered list."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, value: Any,
                 opt: str | None = None) -> None:
        name, sep, rest = str(value).partition("=")
        if not sep or not name or not rest:
            parser.error(f"{opt} wants NAME=VALUE, got {value!r}")
        configs = list(getattr(ns, self.dest) or [])
        if any(c.name == name for c in configs):
            parser.error(f"configuration {name!r} given twice")
        kind = "url" if opt == "--config" else "command"
        configs.append(Configuration(name, **{kind: rest}))
        setattr(ns, self.dest, configs)


def _rates(args: argparse.Namespace) -> list[float]:
    rates = sorted(float(r) for r in args.rates.split(","))
    return rates[::2] if args.quick and len(rates) > 3 else rates


async def _run_config(args: argparse.Namespace, config: Configuration, rates: list[float],
                      ref: Unloaded | None, out: Path, sink: TextIO) -> tuple[Unloaded, Slo, list[dict[str, Any]]]:
    url = config.endpoint()
    model = args.model or await fetch_model(url)
    base = client_config(args, url, model)
    space = spec_from_args(args, TokenSpace, "")
    first = build_workload(args, rates[0], args.seed * 1000)
    shape = first.probe_shape()
    long_prompt = first.long_probe_prompt() if args.ttft_slo_per_length else 0
    unloaded = await measure_unloaded(base, shape, space, args.unloaded_samples, args.seed, long_prompt)
    if args.ttft_slo_ms and args.tpot_slo_ms:
        slo = fixed_slo(args)
    else:
        slo = (ref if args.slo_ref == "first" and ref else unloaded).slo(args.ttft_slo_mult, args.tpot_slo_mult)
    sending = 0.75 * args.point_seconds
    cfg = dataclasses.replace(base, max_duration_s=sending, grace_s=args.point_seconds - sending)
    points = []
    for i, rate in enumerate(rates):
        seed = 1000 * args.seed + i
        n = max(1, math.ceil(rate * sending))
        if args.workload == "mixed":  # as many requests as the point has time for, or fewer
            wl = build_workload(argparse.Namespace(**{**vars(args), "num_requests": min(n, args.num_requests or n)}),
                                rate, seed)
        else:
            wl = build_workload(args, rate, seed).truncate(n)
        point = await run_point(wl, cfg, slo, args.prewarm_concurrency)
        rec = {"config": config.name, "rate": rate, "model": model, "url": url, "command": config.command,
               "slo": dataclasses.asdict(slo), "unloaded": dataclasses.asdict(unloaded), **point.record}
        sink.write(json.dumps(rec) + "\n")
        sink.flush()
        write_requests(out / "requests" / f"{config.name}_r{rate:g}.jsonl", point.results)
        rec["attainment_at_scale"] = attainment_at_scales(point.results, slo, SLO_SCALES)
        points.append(rec)
        s = point.record["summary"]
        print(f"[sweep] {config.name} @ {rate:g} req/s: goodput {s['goodput']:.2f} req/s, "
              f"attainment {s['attainment']:.0%}, failed {s['failed']}", file=sys.stderr)
    return unloaded, slo, points


def _plot(results: dict[str, dict[str, Any]], out: Path, title: str, scale_at: int) -> None:
    from planner.plots import plot_attainment_vs_slo_scale, plot_goodput_vs_rate, plot_latency_vs_rate

    curves = {name: r["points"] for name, r in results.items()}
    slos = {name: (r["slo"]["ttft_s"], r["slo"]["tpot_s"]) for name, r in results.items()}
    plot_latency_vs_rate(curves, out / "latency_vs_rate.png", title, slos)
    plot_goodput_vs_rate(curves, out / "goodput_vs_rate.png", title)
    scale_curves = {}
    for name, pts in curves.items():
        p = pts[min(scale_at, len(pts) - 1)]
        scale_curves[name] = (p["rate"], SLO_SCALES, p["attainment_at_scale"])
    plot_attainment_vs_slo_scale(scale_curves, out / "goodput_vs_slo_scale.png", title)


async def _sweep(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    (out / "requests").mkdir(parents=True, exist_ok=True)
    rates = _rates(args)
    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    ref: Unloaded | None = None
    with open(out / "sweep.jsonl", "a") as sink:
        for config in args.configs:
            launched = None
            try:
                if config.command:
                    launched = Launched(config, open(out / f"{config.name}.log", "w"))
                    launched.wait_ready(args.ready_timeout)
                unloaded, slo, points = await _run_config(args, config, rates, ref, out, sink)
            except (RuntimeError, OSError, httpx.HTTPError, aiohttp.ClientError) as e:
                failed[config.name] = f"{type(e).__name__}: {e}"  # the other configurations still run
                print(f"[sweep] {config.name} failed: {e}", file=sys.stderr)
                continue
            finally:
                if launched:
                    launched.stop()
                    launched.log.close()
            ref = ref or unloaded
            results[config.name] = {
                "url": config.endpoint(), "command": config.command, "unloaded": dataclasses.asdict(unloaded),
                "slo": dataclasses.asdict(slo), "max_rate_90": max_rate_meeting(points),
                "points": points,
            }
    scale_at = args.scale_at if args.scale_at is not None else len(rates) // 2
    title = (f"{args.workload}: TTFT <= {args.ttft_slo_mult:g}x, TPOT <= {args.tpot_slo_mult:g}x unloaded "
             f"({args.slo_ref}); {machine_info()['platform']}, {machine_info()['cpu_count']} CPUs")
    if results:
        _plot(results, out, title, scale_at)
    def point(s: dict[str, Any]) -> dict[str, Any]:   # one point's summary, briefly
        return {"ttft_p50": summary_stat(s, "ttft_s", "p50"), "ttft_p99": summary_stat(s, "ttft_s", "p99"),
                "tpot_p50": summary_stat(s, "tpot_s", "p50"), "tpot_p99": summary_stat(s, "tpot_s", "p99"),
                "goodput": s["goodput"], "attainment": s["attainment"], "issued": s["issued"],
                "failed": s["failed"], "cached_fraction": s["cached_fraction"],
                "send_lag_p99": summary_stat(s, "send_lag_s", "p99")}

    brief = {name: {**{k: v for k, v in r.items() if k != "points"},
                    "curve": [{"rate": p["rate"], **point(p["summary"])} for p in r["points"]]}
             for name, r in results.items()}
    return {"bench": "sweep", "workload": args.workload, "rates": rates, "quick": args.quick,
            "point_seconds": args.point_seconds, "slo_scales": SLO_SCALES,
            "scale_at_rate": rates[min(scale_at, len(rates) - 1)],
            "scaling": build_workload(args, rates[0], args.seed * 1000).scaling, "machine": machine_info(),
            "configs": brief, "failed": failed, "out": str(out)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving.sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--config", dest="configs", action=_ConfigAction, metavar="NAME=URL",
                        help="a running endpoint (repeatable)")
    parser.add_argument("--launch", dest="configs", action=_ConfigAction, metavar="NAME=COMMAND",
                        help="a command that serves an endpoint; started and stopped by the sweep (repeatable)")
    parser.add_argument("--rates", default="0.5,1,2,4,8", help="comma-separated requests/s")
    parser.add_argument("--quick", action="store_true", help="30 s points, every other rate")
    parser.add_argument("--point-seconds", type=float, default=None, help="bound of one point (default 120; quick 30)")
    parser.add_argument("--unloaded-samples", type=int, default=3,
                        help="unloaded requests, one at a time, that fix the objectives (default 3)")
    parser.add_argument("--slo-ref", choices=("first", "own"), default="first",
                        help="objectives from the first configuration's unloaded latency, or each one's own")
    parser.add_argument("--scale-at", type=int, default=None, help="rate index of the SLO-scale plot (default: middle)")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds a --launch command has to answer GET /v1/models (default 600)")
    parser.add_argument("--out", default="sweep_results",
                        help="directory for sweep.jsonl, requests/ and the PNGs (default %(default)s)")
    add_bench_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.configs:
        parser.error("give at least one --config NAME=URL or --launch NAME=COMMAND")
    if args.point_seconds is None:
        args.point_seconds = 30.0 if args.quick else 120.0
    if not 0 < args.point_seconds <= 120:
        parser.error("--point-seconds must be in (0, 120]")
    pin_client(args.client_cpus)
    try:
        record = asyncio.run(_sweep(args))
    except (ValueError, RuntimeError, OSError, httpx.HTTPError, aiohttp.ClientError) as e:
        sys.exit(f"sweep: {e}")
    emit(record)
    if record["failed"]:
        sys.exit(f"sweep: configurations that did not run: {', '.join(record['failed'])}")


if __name__ == "__main__":
    sys.exit(lifecycle.run_main(main))
