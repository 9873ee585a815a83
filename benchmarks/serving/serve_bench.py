"""Serving benchmark: drive an OpenAI-compatible endpoint with a seeded streaming workload.

Measures per request TTFT, TPOT, ITL and E2E on the client (see ``load_client`` and
``planner.metrics`` for the definitions), and prints one JSON line: the configuration, the
machine, the workload's scaling, p50/p90/p99, throughput and, given objectives, goodput and
attainment, overall and per request tag. ``--out DIR`` also writes every request as a JSON line
and a PNG of the TTFT/TPOT/ITL distributions.

    python -m benchmarks.serving.serve_bench --url http://127.0.0.1:8000 --workload mixed --rate 2
    python -m benchmarks.serving.serve_bench --workload trace --trace-time-scale 4 --out results/trace
    python -m benchmarks.serving.serve_bench --workload multi_turn --rate 1 --slo-from-unloaded 3

Objectives: ``--ttft-slo-ms``/``--tpot-slo-ms``, or ``--slo-from-unloaded N``: the median of N
unloaded requests of the workload's typical shape, times ``--ttft-slo-mult`` (5) and
``--tpot-slo-mult`` (2). Runs are bounded: nothing is sent after ``--max-duration`` seconds and
whatever is in flight ``--grace`` seconds later is cancelled (and counted as failed).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from benchmarks.report import emit, machine_info, write_json
from benchmarks.serving.load_client import ClientConfig, RunOutcome, fetch_model, run_workload
from planner.metrics import RequestResult, Slo, Unloaded, summarize, summarize_by_tag
from planner.workload_args import add_workload_args, build_workload, spec_from_args
from planner.workloads import BenchRequest, TokenSpace, Workload

__all__ = ["add_bench_args", "client_config", "measure_unloaded", "run_point",
           "pin_client", "write_requests", "PointResult"]

def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Workload, client and objective flags shared by ``serve_bench`` and ``sweep``."""
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    default = {f.name: f.default for f in dataclasses.fields(ClientConfig)}  # defaults live there
    parser.add_argument("--max-duration", type=float, default=default["max_duration_s"],
                        help="send nothing after this many seconds")
    parser.add_argument("--grace", type=float, default=default["grace_s"],
                        help="cancel what is in flight this long after that")
    parser.add_argument("--request-timeout", type=float, default=default["request_timeout_s"],
                        help="seconds one request may take before it counts as failed (default %(default)s)")
    parser.add_argument("--max-concurrency", type=int, default=default["max_concurrency"],
                        help="0: unbounded (open loop)")
    parser.add_argument("--prewarm-concurrency", type=int, default=4,
                        help="requests in flight while sending the pre-warm set, untimed (default 4)")
    parser.add_argument("--salt-per-request", action="store_true",
                        help="a cache_salt of its own for every request (a per-run nonce + its id): "
                             "no prefix reuse between requests, nor with an earlier run of the same prompts")
    parser.add_argument("--ttft-slo-ms", type=float, default=None, help="time-to-first-token objective (ms)")
    parser.add_argument("--tpot-slo-ms", type=float, default=None, help="time-per-output-token objective (ms)")
    parser.add_argument("--ttft-slo-per-token-ms", type=float, default=0.0,
                        help="with --ttft-slo-ms: the TTFT objective grows this much per prompt token "
                             "beyond --ttft-slo-ref-tokens")
    parser.add_argument("--ttft-slo-ref-tokens", type=int, default=0,
                        help="prompt length at which the TTFT objective is --ttft-slo-ms (default 0)")
    parser.add_argument("--ttft-slo-per-length", action="store_true",
                        help="unloaded objectives: also probe the workload's 90th-percentile prompt length, "
                             "and give each request the TTFT multiple at its own length (a line through both)")
    parser.add_argument("--ttft-slo-mult", type=float, default=5.0, help="TTFT objective / unloaded TTFT")
    parser.add_argument("--tpot-slo-mult", type=float, default=2.0, help="TPOT objective / unloaded TPOT")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--client-cpus", default=None,
                        help="pin the load generator to these CPUs (e.g. 0 or 0,1); recorded with the machine")
    add_workload_args(parser)


def fixed_slo(args: argparse.Namespace) -> Slo:
    """The objectives ``--ttft-slo-ms``/``--tpot-slo-ms`` (+ the per-token slope) fix."""
    return Slo(args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3, args.ttft_slo_per_token_ms / 1e3,
               args.ttft_slo_ref_tokens)


def client_config(args: argparse.Namespace, url: str, model: str) -> ClientConfig:
    return ClientConfig(url, model, request_timeout_s=args.request_timeout, max_duration_s=args.max_duration,
                        grace_s=args.grace, max_concurrency=args.max_concurrency, progress=not args.no_progress,
                        request_salt=os.urandom(4).hex() + "-" if args.salt_per_request else None)


def pin_client(cpus: str | None) -> None:
    """Pin this process (the load generator) to ``cpus``, a comma list of CPU ids."""
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


async def _one_at_a_time(cfg: ClientConfig, space: TokenSpace, shape: tuple[int, int], n: int,
                         seed: int, tag: str, warmup: int = 0) -> list[RequestResult]:
    """``warmup`` + ``n`` requests of ``shape`` sent one at a time, each with fresh tokens (no
    prefix hit between them); the ok ones of the last ``n``."""
    rng = np.random.default_rng([seed, 4, shape[0]])
    reqs = [BenchRequest(f"{tag}-{seed}-{i}", space.random(rng, shape[0]), shape[1], tag="unloaded")
            for i in range(warmup + n)]
    out = await run_workload(reqs, dataclasses.replace(cfg, max_concurrency=1, progress=False), desc=tag)
    byid = {r.request_id: r for r in out.results}
    measured = [byid[r.request_id] for r in reqs[warmup:] if r.request_id in byid and byid[r.request_id].ok]
    if not measured or any(r.tpot_s is None for r in measured):
        errors = [r.error for r in out.results if r.error]
        raise RuntimeError(f"unloaded measurement of {shape[0]}-token prompts failed: {errors[:3]}")
    return measured


async def measure_unloaded(cfg: ClientConfig, shape: tuple[int, int], space: TokenSpace,
                           n: int = 3, seed: int = 0, long_prompt: int = 0) -> Unloaded:
    """One warm-up and ``n`` requests of ``shape``, one at a time; medians of the ``n``. With
    ``long_prompt`` > ``shape[0]``, also ``n`` requests of that many prompt tokens (TTFT only)."""
    measured = await _one_at_a_time(cfg, space, shape, n, seed, "unloaded", warmup=1)
    u = Unloaded(shape[0], shape[1], statistics.median(r.ttft_s for r in measured),
                 statistics.median(r.tpot_s for r in measured), len(measured))
    if long_prompt > shape[0]:
        longs = await _one_at_a_time(cfg, space, (long_prompt, 2), n, seed, "unloaded-long")
        u = dataclasses.replace(u, long_prompt_tokens=long_prompt,
                                long_ttft_s=statistics.median(r.ttft_s for r in longs))
    return u


@dataclasses.dataclass
class PointResult:
    record: dict[str, Any]  # the JSON line
    results: list[RequestResult]


async def run_point(workload: Workload, cfg: ClientConfig, slo: Slo | None,
                    prewarm_concurrency: int = 4) -> PointResult:
    """Pre-warm (untimed), then run the workload and summarize it."""
    warm: dict[str, Any] = {"sent": 0}
    if workload.prewarm:
        t = time.perf_counter()
        wcfg = dataclasses.replace(cfg, max_concurrency=prewarm_concurrency, max_duration_s=1e9)
        w = await run_workload(workload.prewarm, wcfg, desc="prewarm")
        warm = {"sent": len(w.results), "failed": sum(not r.ok for r in w.results),
                "seconds": time.perf_counter() - t}
    out: RunOutcome = await run_workload(workload.requests, cfg, desc=workload.name)
    summary = summarize(out.results, out.duration_s, slo)
    record = {
        "workload": workload.name, "scaling": workload.scaling,
        "requests": len(workload.requests), "not_sent": out.not_sent, "prewarm": warm,
        "summary": summary.to_json(),
        "by_tag": {k: v.to_json() for k, v in summarize_by_tag(out.results, out.duration_s, slo).items()},
        "errors": sorted({r.error for r in out.results if r.error})[:5],
    }
    return PointResult(record, out.results)


def write_requests(path: Path, results: list[RequestResult]) -> None:
    with open(path, "w") as f:
        for r in sorted(results, key=lambda r: r.sent_s):
            f.write(json.dumps(r.to_json()) + "\n")


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or await fetch_model(args.url)
    cfg = client_config(args, args.url, model)
    workload = build_workload(args, args.rate, args.seed)
    unloaded = None
    slo = None
    if args.ttft_slo_ms and args.tpot_slo_ms:
        slo = fixed_slo(args)
    elif args.slo_from_unloaded:
        space = spec_from_args(args, TokenSpace, "")
        unloaded = await measure_unloaded(cfg, workload.probe_shape(), space, args.slo_from_unloaded, args.seed,
                                          workload.long_probe_prompt() if args.ttft_slo_per_length else 0)
        slo = unloaded.slo(args.ttft_slo_mult, args.tpot_slo_mult)
    point = await run_point(workload, cfg, slo, args.prewarm_concurrency)
    record = {"bench": "serve_bench", "url": args.url, "model": model, "rate": args.rate,
              "machine": machine_info(), "config": vars(args),
              "unloaded": dataclasses.asdict(unloaded) if unloaded else None, **point.record}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_requests(out / "requests.jsonl", point.results)
        from planner.plots import plot_cdfs

        title = f"{workload.name} @ {args.rate} req/s, {model}, {record['machine']['platform']}"
        plot_cdfs(point.results, out / "latency_cdf.png", title, (slo.ttft_s, slo.tpot_s) if slo else None)
        write_json(out / "summary.json", record)
    return record


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving.serve_bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the endpoint (loopback only)")
    parser.add_argument("--rate", type=float, default=None,
                        help="requests/s, Poisson (inf: all at once); trace default: its own timing")
    parser.add_argument("--slo-from-unloaded", type=int, default=0, metavar="N",
                        help="measure N unloaded requests first and derive the objectives from them")
    parser.add_argument("--out", default=None, help="directory for requests.jsonl, summary.json, latency_cdf.png")
    add_bench_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    pin_client(args.client_cpus)
    try:
        record = asyncio.run(_main(args))
    except (ValueError, RuntimeError, OSError, aiohttp.ClientError) as e:
        sys.exit(f"serve_bench: {e}")
    emit(record)


if __name__ == "__main__":
    main()
