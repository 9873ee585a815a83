"""The autoscaling benchmark: a workload that turns from decode-heavy to prefill-heavy
halfway, served by every static configuration and by the autoscaled cluster, one after
another in one run, on the same two-worker budget.

    flock /tmp/bench.lock .venv/bin/python -m benchmarks.planner.autoscale_bench --out results/autoscale
    .venv/bin/python -m benchmarks.planner.autoscale_bench --quick --out results/autoscale_quick

Workload (``planner.workloads.MixedSpec``, seeded; token-id prompts, ``ignore_eos``, greedy,
every request its own ``cache_salt``): for ``--phase-seconds`` short requests alone
(``--decode-prompt`` tokens, ``--decode-output`` out: decode-heavy), then for as long a mix
where ``--prefill-share`` of the requests are huge prefills (``--prefill-prompt`` tokens,
``--prefill-output`` out) and the rest short ones of ``--prefill-short-output`` tokens
(prefill-heavy), its arrivals shifted by the first half.

The load and the objectives follow the machine (its speed here moves 2x with what else runs):
the first configuration is warmed, then probed (``probe``): ``--probes`` short and huge
requests one at a time (unloaded), then as many short requests at once as the budget's two KV
caches hold (``--num-blocks`` each, at the longest short prompt), whose TPOT is the decode step
with the caches full. From them (``calibrate``): the decode-heavy rate holds ``--decode-load``
(1.2) x what one worker's cache holds at once, each request living its output at the full-cache
TPOT plus its unloaded TTFT, so one decode worker cannot keep up and two can; the prefill-heavy
rate sends huge prefills at ``--prefill-load`` (0.6) x what one worker prefills a second;
objectives TTFT ``--ttft-slo-mult`` (5) x the unloaded TTFT at each prompt length (the line
through both probes) and TPOT ``--tpot-slo-mult`` (3) x the unloaded TPOT of a lone request,
the same for every configuration (``--decode-rate``, ``--prefill-rate``, ``--ttft-slo-ms``,
``--ttft-slo-per-token-ms``, ``--tpot-slo-ms`` fix them instead). The load used to come from
the unloaded TPOT times a fixed 2 (what two workers decoding at once had measured); a run whose
lone requests were slow (a cold worker, a slow moment) then set a load every layout met.

Configurations (``CONFIGS``, the first one probed), each ``kvrouter up`` with two CPUs' worth
of workers (one torch thread each, unpinned; ``colocated_1x2`` one worker of two threads) and
the same KV blocks in all (``--num-blocks`` a worker, twice that for the single worker):

- ``colocated_2x1``: ``--mode auto`` with two decode workers and no prefill worker: each
  serves its requests whole (the autoscaler's colocated state);
- ``colocated_1x2``: ``--mode colocated``, one worker of two threads;
- ``disagg_1p1d``: 1 prefill + 1 decode worker, ``--mode disaggregated``;
- ``auto_1p1d``: the same in ``--mode auto`` (short prompts prefill on their decode worker);
- ``autoscaled``: ``--autoscale --max-workers 2`` in ``--mode auto``, starting in the
  colocated state (two decode workers, no prefill pool: what ``kvplan recommend`` recommends
  for this machine, and the layout a cluster is rolled back to); the router's objectives
  follow the SLOs (``--scale-ttft-target`` the TTFT objective at the huge prompt,
  ``--scale-itl-target`` ``--itl-target-share`` x the TPOT objective) with the ``--scale-*``
  timings below.

The defaults were chosen with the simulator (``kvplan``, ``planner.sim.autoscale``) so that
the two halves favor different layouts, the case an autoscaler is for: the decode-heavy half
is bound by KV capacity (two decode workers hold it, one cannot), the prefill-heavy half by
huge prefills stalling the decodes that share their worker (a split keeps one worker's decodes
clean). ``--profile`` (repeat per thread count) also simulates every configuration on the same
workload and objectives and puts the prediction beside each measurement (``simulated``).

Goodput: requests that met both objectives over the workload's length (``2 x
--phase-seconds``), over the whole run and per half. The verdict,
``autoscaled_over_best_static``, is the autoscaled goodput over the best static one (target >= 1).

Writes ``OUT/autoscale.json`` (also printed as one JSON line), ``OUT/autoscale.png`` (the
autoscaled cluster's layout, pressures and role changes over time; attainment over time
against the best static configuration; goodput per configuration and half) and, per
configuration, ``OUT/NAME/``: ``up.log``, the cluster's logs (``autoscale.jsonl``: the
autoscaler's timeline), ``requests.jsonl``, and with ``--step-trace`` each worker's steps. A
configuration that does not start is an ``error`` (exit status 1). SIGTERM/SIGINT stop what
runs (``benchmarks.lifecycle``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from benchmarks import lifecycle
from benchmarks.lifecycle import Configuration, Launched, kvrouter_up
from benchmarks.planner.autoscale_plot import plot
from benchmarks.report import emit, machine_info, write_json
from benchmarks.serving.load_client import ClientConfig, fetch_model, run_workload, stream_completion
from planner.metrics import RequestResult, Slo, summarize
from planner.workloads import BenchRequest, MixedSpec, TokenSpace, Workload

PY = sys.executable
CONFIGS: dict[str, str] = {
    "colocated_2x1": "--mode auto --prefill 0 --decode 2",
    "colocated_1x2": "--mode colocated --threads-per-worker 2",
    "disagg_1p1d": "--mode disaggregated --prefill 1 --decode 1",
    "auto_1p1d": "--mode auto --prefill 1 --decode 1",
    "autoscaled": "--autoscale --max-workers 2 --prefill 0 --decode 2",
}
STATIC = [n for n in CONFIGS if n != "autoscaled"]
PHASES = ("decode_heavy", "prefill_heavy")


@dataclass(frozen=True)
class Probe:
    """The first configuration's latencies (medians): one request at a time, and with the KV
    caches full."""

    ttft_short_s: float
    tpot_s: float
    ttft_long_s: float
    tpot_full_s: float


def slots(args: argparse.Namespace) -> int:
    """Short requests one worker's KV cache holds at once, at the longest short prompt (the
    workload's prompts reach 1.25x their mean)."""
    return max(1, args.num_blocks // math.ceil((args.decode_prompt * 1.25 + args.decode_output) / 16))


async def warm(url: str, model: str, short: tuple[int, ...], long: tuple[int, ...]) -> None:
    """One short and one huge request, so no probe or measurement pays a cold worker's first steps."""
    warmup = [BenchRequest("warm-short", short, 4), BenchRequest("warm-long", long, 2, after="warm-short")]
    await run_workload(warmup, ClientConfig(url, model, progress=False, request_salt=f"warm-{uuid.uuid4().hex[:8]}-"))


async def probe(url: str, model: str, args: argparse.Namespace, space: TokenSpace) -> Probe:
    """``--probes`` short requests (``--decode-prompt`` tokens, 32 out) and as many huge
    prefills (``--prefill-prompt`` tokens, 2 out), each alone; then ``2 x slots`` short
    requests (``--decode-output`` out) at once, the budget's two KV caches full."""
    rng = np.random.default_rng([args.seed, 4])
    await warm(url, model, space.random(rng, args.decode_prompt), space.random(rng, args.prefill_prompt))
    cfg = ClientConfig(url, model, progress=False, request_salt=f"probe-{uuid.uuid4().hex[:8]}-")
    got: dict[str, list[RequestResult]] = {"s": [], "l": []}
    async with aiohttp.ClientSession() as session:
        for i, (kind, prompt, out) in enumerate([("s", args.decode_prompt, 32)] * args.probes
                                                + [("l", args.prefill_prompt, 2)] * args.probes):
            req = BenchRequest(f"probe-{i}", space.random(rng, prompt), out)
            res = RequestResult(req.request_id, kind, prompt, out)
            await stream_completion(session, cfg, req, res, time.perf_counter())
            if res.error or res.ttft_s is None:
                raise RuntimeError(f"probe {req.request_id} failed: {res.error}")
            got[kind].append(res)
    full = [BenchRequest(f"probe-full-{i}", space.random(rng, args.decode_prompt), args.decode_output)
            for i in range(2 * slots(args))]
    outcome = await run_workload(full, cfg)
    tpots = [r.tpot_s for r in outcome.results if not r.error and r.tpot_s]
    if len(tpots) < len(full):
        raise RuntimeError(f"the full-cache probe failed: {len(tpots)} of {len(full)} requests completed")
    return Probe(statistics.median(r.ttft_s or 0.0 for r in got["s"]),
                 statistics.median(r.tpot_s or 0.0 for r in got["s"]),
                 statistics.median(r.ttft_s or 0.0 for r in got["l"]),
                 statistics.median(tpots))


def calibrate(args: argparse.Namespace, p: Probe) -> tuple[float, float, Slo]:
    """(decode-heavy rate, prefill-heavy rate, objectives) from the probe, unless given.

    Decode-heavy: ``--decode-load`` x what one worker's KV cache holds at once (``slots``), over
    a request's life (its output at the full-cache TPOT, plus its unloaded TTFT): one decode
    worker cannot hold that, two can. Prefill-heavy: huge prefills at ``--prefill-load`` x what
    one worker prefills a second (1 / their unloaded TTFT), ``--prefill-share`` of the
    requests. Objectives: TTFT ``--ttft-slo-mult`` x the unloaded TTFT at each prompt length
    (the line through both probes), TPOT ``--tpot-slo-mult`` x the unloaded TPOT."""
    life = args.decode_output * p.tpot_full_s + p.ttft_short_s
    decode_rate = args.decode_rate or args.decode_load * slots(args) / life
    prefill_rate = args.prefill_rate or args.prefill_load / p.ttft_long_s / args.prefill_share
    ttft = args.ttft_slo_ms / 1e3 if args.ttft_slo_ms else args.ttft_slo_mult * p.ttft_short_s
    slope = (args.ttft_slo_per_token_ms / 1e3 if args.ttft_slo_per_token_ms is not None else
             max(0.0, args.ttft_slo_mult * p.ttft_long_s - ttft) / (args.prefill_prompt - args.decode_prompt))
    slope = min(slope, 0.9 * ttft / args.decode_prompt)   # the objective stays positive at 0 tokens
    tpot = args.tpot_slo_ms / 1e3 if args.tpot_slo_ms else args.tpot_slo_mult * p.tpot_s
    return decode_rate, prefill_rate, Slo(ttft, tpot, slope, args.decode_prompt)


def given(args: argparse.Namespace) -> bool:
    """Whether the flags fix both rates and every objective, so no probe is needed (a repeat of
    an earlier run, with its ``workload`` and ``slo`` passed back as flags)."""
    return None not in (args.decode_rate, args.prefill_rate, args.ttft_slo_ms, args.ttft_slo_per_token_ms,
                        args.tpot_slo_ms)


def shifting_workload(args: argparse.Namespace, space: TokenSpace) -> Workload:
    """Decode-heavy for ``phase_seconds``, then prefill-heavy for as long (module docstring)."""
    half = args.phase_seconds

    def half_of(spec: MixedSpec, rate: float, seed: int, tag: str, shift: float) -> list[BenchRequest]:
        n = max(1, math.ceil(rate * half * 2) + 10)   # more than the half needs; cut at its end
        built = spec.build(n, rate, seed, space).requests
        return [replace(r, request_id=f"{tag}-{i}", arrival_s=r.arrival_s + shift, tag=tag)
                for i, r in enumerate(built) if r.arrival_s < half]

    decode = MixedSpec(short_prompt=args.decode_prompt, short_output=args.decode_output, long_share=0.0)
    prefill = MixedSpec(short_prompt=args.decode_prompt, short_output=args.prefill_short_output,
                        long_prompt=args.prefill_prompt, long_output=args.prefill_output,
                        long_share=args.prefill_share)
    requests = (half_of(decode, args.decode_rate, args.seed, PHASES[0], 0.0)
                + half_of(prefill, args.prefill_rate, args.seed + 1, PHASES[1], half))
    return Workload("decode_then_prefill", requests, scaling={
        "phase_seconds": half, "decode": {"rate": args.decode_rate, "prompt": args.decode_prompt,
                                          "output": args.decode_output},
        "prefill": {"rate": args.prefill_rate, "long_share": args.prefill_share, "prompt": args.prefill_prompt,
                    "output": args.prefill_output, "short_output": args.prefill_short_output},
        "requests": {t: sum(r.tag == t for r in requests) for t in PHASES}})


def up_flags(name: str, args: argparse.Namespace, slo: Slo | None) -> str:
    blocks = args.num_blocks * (2 if name == "colocated_1x2" else 1)
    flags = f"{CONFIGS[name]} --worker-arg=--num-blocks={blocks}"
    if "--threads-per-worker" not in flags:
        flags += " --threads-per-worker 1"
    if name == "autoscaled":
        assert slo is not None
        flags += (f" --scale-ttft-target {slo.ttft_objective(args.prefill_prompt):.3f}"
                  f" --scale-itl-target {args.itl_target_share * slo.tpot_s:.4f}"
                  f" --scale-up-for {args.scale_up_for} --scale-down-for {args.scale_down_for}"
                  f" --scale-cooldown {args.scale_cooldown} --scale-window {args.scale_window}"
                  f" --scale-prefill-share {args.scale_prefill_share}"
                  f" --autoscale-interval 1")
    return flags


def scored(results: list[RequestResult], slo: Slo, seconds: float) -> dict[str, Any]:
    """Goodput over a fixed length, with the summary's latencies."""
    s = summarize(results, max(seconds, 1e-9), slo)
    pick = lambda d: None if d is None else {k: round(getattr(d, k), 4) for k in ("p50", "p90", "p99")}  # noqa: E731
    return {"issued": s.issued, "completed": s.completed, "failed": s.failed, "good": s.good,
            "goodput": (s.good or 0) / seconds, "attainment": s.attainment,
            "ttft_s": pick(s.ttft_s), "tpot_s": pick(s.tpot_s)}


def read_timeline(path: Path, t0: float) -> list[dict[str, Any]]:
    """The autoscaler's ``autoscale.jsonl``, times as seconds since the workload's start."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        rec["t"] = round(rec["t_unix"] - t0, 3)
        if "started_unix" in rec:
            rec["started"] = round(rec["started_unix"] - t0, 3)
        out.append(rec)
    return out


@dataclass
class Plan:
    """The workload and objectives, fixed by the first configuration's probe (``calibrate``)."""

    workload: Workload | None = None
    slo: Slo | None = None
    probe: Probe | None = None


def run_config(name: str, args: argparse.Namespace, plan: Plan, space: TokenSpace, out: Path) -> dict[str, Any]:
    cdir = out / name
    shutil.rmtree(cdir / "logs", ignore_errors=True)   # an earlier run's timeline is not this one's
    cdir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {}
    launched = None
    try:
        if plan.slo is None and name == "autoscaled":
            raise RuntimeError("the autoscaled cluster's objectives come from a static configuration's "
                               "probe: list one before it in --configs, or give both rates and every "
                               "objective (--decode-rate, --prefill-rate, --ttft-slo-ms, "
                               "--ttft-slo-per-token-ms, --tpot-slo-ms)")
        if args.step_trace:   # each worker's steps: OUT/NAME/steps-ROLE-PID.jsonl
            for old in cdir.glob("steps-*.jsonl"):
                old.unlink()
        command = kvrouter_up(args.model, args.port, cdir / "logs", args.store_memory,
                              up_flags(name, args, plan.slo),
                              step_trace_dir=cdir.resolve() if args.step_trace else None)
        res["command"] = command.replace(PY, "python")
        launched = Launched(Configuration(name, command=command), open(cdir / "up.log", "w"))
        launched.wait_ready(args.ready_timeout)
        url = f"http://127.0.0.1:{args.port}"
        model = asyncio.run(fetch_model(url))
        if plan.workload is None:   # the first configuration: probe, then fix the load and objectives
            plan.probe = asyncio.run(probe(url, model, args, space))
            args.decode_rate, args.prefill_rate, plan.slo = calibrate(args, plan.probe)
            plan.workload = shifting_workload(args, space)
            res["probed"] = True
            print(f"[autoscale_bench] probe on {name}: {plan.probe}; rates {args.decode_rate:.3f} / "
                  f"{args.prefill_rate:.3f} req/s; {plan.slo}", file=sys.stderr, flush=True)
        workload, slo = plan.workload, plan.slo
        assert slo is not None
        longest = max(workload.requests, key=lambda r: len(r.prompt))
        asyncio.run(warm(url, model, workload.requests[0].prompt, longest.prompt))
        total = 2 * args.phase_seconds
        cfg = ClientConfig(url, model, max_duration_s=total, grace_s=args.grace_seconds, progress=False,
                           request_timeout_s=total + args.grace_seconds,
                           request_salt=f"{name}-{uuid.uuid4().hex[:8]}-")
        t0 = time.time()
        outcome = asyncio.run(run_workload(workload.requests, cfg, desc=name))
        results = outcome.results
        with open(cdir / "requests.jsonl", "w") as f:
            for r in sorted(results, key=lambda r: r.scheduled_s):
                f.write(json.dumps({**r.to_json(), "met": slo.met(r)}) + "\n")
        res.update(whole=scored(results, slo, total), not_sent=outcome.not_sent,
                   phases={t: scored([r for r in results if r.tag == t], slo, total / 2) for t in PHASES},
                   requests=[{"t": round(r.scheduled_s, 2), "tag": r.tag, "met": slo.met(r)}
                             for r in sorted(results, key=lambda r: r.scheduled_s)])
        timeline = read_timeline(cdir / "logs" / "autoscale.jsonl", t0)
        if timeline:
            res["actions"] = [{k: a.get(k) for k in ("started", "t", "action", "worker", "from", "to", "seconds",
                                                       "layout_before", "layout_after")}
                              for a in timeline if a["kind"] == "action"]
            res["timeline"] = [{"t": s["t"], "prefill": s["prefill"], "decode": s["decode"],
                                "pressure": {p: s["pools"][p]["pressure"] for p in ("prefill", "decode")}}
                               for s in timeline if s["kind"] == "signals"]
        print(f"[autoscale_bench] {name}: goodput {res['whole']['goodput']:.3f} req/s "
              f"({res['whole']['good']}/{res['whole']['issued']})", file=sys.stderr, flush=True)
    except (RuntimeError, OSError) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[autoscale_bench] {name} failed, nothing measured: {res['error']}", file=sys.stderr, flush=True)
    finally:
        if launched is not None:
            launched.stop()
            launched.log.close()
    return res


def simulate(names: list[str], args: argparse.Namespace, workload: Workload, slo: Slo) -> dict[str, Any]:
    """Each configuration in the simulator (``--profile``), from its own ``kvrouter up`` flags,
    on the measured run's workload and objectives: the whole run's and each half's goodput, and
    the autoscaler's actions."""
    from planner.sim.cluster import SimCluster
    from planner.sim.config import from_up_flags
    from planner.sim.run import Profiles

    profiles = Profiles.from_files(args.profile)
    total = 2 * args.phase_seconds
    out: dict[str, Any] = {}
    for name in names:
        cfg = from_up_flags(name, f"--store-memory {args.store_memory} {up_flags(name, args, slo)}")
        run = SimCluster(cfg, profiles.costs_for).run_workload(workload.requests, max_duration_s=total,
                                                               grace_s=args.grace_seconds)
        out[name] = {"whole": scored(run.results, slo, total),
                     "phases": {t: scored([r for r in run.results if r.tag == t], slo, total / 2) for t in PHASES},
                     "actions": [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in a.items()
                                  if k in ("started", "t", "action", "worker", "to", "seconds", "layout_after")}
                                 for a in run.autoscale_actions]}
    return out


def verdict(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    statics = {n: c["whole"]["goodput"] for n, c in configs.items() if n in STATIC and "whole" in c}
    auto = configs.get("autoscaled", {}).get("whole", {}).get("goodput")
    if not statics or auto is None:
        return {"best_static": None, "autoscaled_over_best_static": None, "met": None}
    best = max(statics, key=lambda n: statics[n])
    ratio = auto / statics[best] if statics[best] > 0 else math.inf
    return {"best_static": best, "best_static_goodput": statics[best], "autoscaled_goodput": auto,
            "autoscaled_over_best_static": ratio, "met": ratio >= 1.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner.autoscale_bench",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--out", default="results/autoscale", help="run directory (default %(default)s)")
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M) or a checkpoint directory")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, in order (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="60 s halves (default: --phase-seconds)")
    p.add_argument("--phase-seconds", type=float, default=150.0, help="length of each half (default %(default)s)")
    p.add_argument("--decode-prompt", type=int, default=96,
                   help="mean prompt tokens of a short request, in both halves (default %(default)s)")
    p.add_argument("--decode-output", type=int, default=96,
                   help="decode-heavy half: output tokens (default %(default)s)")
    p.add_argument("--decode-rate", type=float, default=None,
                   help="decode-heavy half: requests/s (default: from the probe and --decode-load)")
    p.add_argument("--decode-load", type=float, default=1.2,
                   help="decode-heavy half: requests held at once over what one worker's KV cache "
                        "holds (default %(default)s)")
    p.add_argument("--prefill-share", type=float, default=0.5,
                   help="prefill-heavy half: the share of huge prefills, the rest short requests (default %(default)s)")
    p.add_argument("--prefill-prompt", type=int, default=512,
                   help="prefill-heavy half: mean prompt tokens of a huge prefill (default %(default)s)")
    p.add_argument("--prefill-output", type=int, default=16,
                   help="prefill-heavy half: output tokens of a huge prefill (default %(default)s)")
    p.add_argument("--prefill-short-output", type=int, default=16,
                   help="prefill-heavy half: output tokens of its short requests (default %(default)s)")
    p.add_argument("--prefill-rate", type=float, default=None,
                   help="prefill-heavy half: requests/s (default: from the probe and --prefill-load)")
    p.add_argument("--prefill-load", type=float, default=0.6,
                   help="prefill-heavy half: huge prefills a second over what one worker prefills "
                        "a second (default %(default)s)")
    p.add_argument("--probes", type=int, default=3, help="unloaded probes of each shape (default %(default)s)")
    p.add_argument("--ttft-slo-mult", type=float, default=5.0,
                   help="TTFT objective: this x the unloaded TTFT at each prompt length (default %(default)s)")
    p.add_argument("--tpot-slo-mult", type=float, default=3.0,
                   help="TPOT objective: this x the unloaded TPOT (default %(default)s)")
    p.add_argument("--ttft-slo-ms", type=float, default=None,
                   help="fix the TTFT objective at --decode-prompt tokens instead (ms)")
    p.add_argument("--ttft-slo-per-token-ms", type=float, default=None,
                   help="fix the TTFT objective's rise per prompt token instead (ms)")
    p.add_argument("--tpot-slo-ms", type=float, default=None, help="fix the TPOT objective instead (ms)")
    p.add_argument("--itl-target-share", type=float, default=0.6,
                   help="the autoscaled router's ITL objective as a share of the TPOT SLO (default %(default)s)")
    p.add_argument("--scale-up-for", type=float, default=5.0,
                   help="the autoscaled router's --scale-up-for (default %(default)s)")
    p.add_argument("--scale-down-for", type=float, default=15.0, help="its --scale-down-for (default %(default)s)")
    p.add_argument("--scale-cooldown", type=float, default=15.0, help="its --scale-cooldown (default %(default)s)")
    p.add_argument("--scale-window", type=float, default=20.0, help="its --scale-window (default %(default)s)")
    p.add_argument("--scale-prefill-share", type=float, default=0.25,
                   help="its --scale-prefill-share: the colocated state's tolerated prefill share "
                        "(default %(default)s)")
    p.add_argument("--num-blocks", type=int, default=96,
                   help="KV blocks of 16 tokens a worker: the decode-heavy half is bound by them "
                        "(default %(default)s)")
    p.add_argument("--store-memory", default="2G", help="the store daemon's arena (default %(default)s)")
    p.add_argument("--grace-seconds", type=float, default=60.0,
                   help="how long in-flight requests may finish after the workload (default %(default)s)")
    p.add_argument("--port", type=int, default=8391,
                   help="the router port of every configuration (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    p.add_argument("--vocab-size", type=int, default=TokenSpace().vocab_size,
                   help="prompt ids stay below this: the model's vocabulary (default %(default)s, SmolLM2's)")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds a cluster has to come up (default %(default)s)")
    p.add_argument("--no-plot", action="store_true", help="do not draw OUT/autoscale.png")
    p.add_argument("--step-trace", action="store_true",
                   help="workers write every engine step to OUT/NAME/steps-ROLE-PID.jsonl "
                        "(kvengine serve --step-trace)")
    p.add_argument("--profile", action="append", default=[], metavar="PATH",
                   help="a `kvengine profile` (repeat per thread count): also simulate every configuration "
                        "(kvplan) on the same workload and objectives, beside the measurement")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.phase_seconds = 60.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit(f"autoscale_bench: unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    space = TokenSpace(vocab_size=args.vocab_size)
    plan = Plan()
    if given(args):   # a repeat: the same workload and objectives, whatever runs first
        plan.slo = calibrate(args, Probe(0.0, 0.0, 0.0, 0.0))[2]
        plan.workload = shifting_workload(args, space)
    t_start = time.time()
    configs: dict[str, dict[str, Any]] = {}
    interrupted = None
    try:
        for name in names:
            configs[name] = run_config(name, args, plan, space, out)
    except lifecycle.Interrupted as stop:
        interrupted = stop
    slo = plan.slo
    if args.profile and plan.workload is not None and slo is not None:
        for name, sim in simulate(names, args, plan.workload, slo).items():
            configs.setdefault(name, {})["simulated"] = sim
    record = {"bench": "autoscale", "machine": machine_info(), "seconds": round(time.time() - t_start, 1),
              "probe": asdict(plan.probe) if plan.probe else None,
              "workload": plan.workload.scaling if plan.workload else {"phase_seconds": args.phase_seconds},
              "slo": None if slo is None else {"ttft_s": slo.ttft_s, "ttft_per_token_s": slo.ttft_per_token_s,
                                               "ref_prompt_tokens": slo.ref_prompt_tokens, "tpot_s": slo.tpot_s},
              "configs": configs, "verdict": verdict(configs),
              "errors": [f"{n}: {c['error']}" for n, c in configs.items() if "error" in c],
              **({"interrupted": str(interrupted)} if interrupted else {})}
    write_json(out / "autoscale.json", record)
    if not args.no_plot and any("whole" in c for c in configs.values()):
        plot(record, out / "autoscale.png")
    emit({k: v for k, v in record.items() if k != "configs"}
                     | {"goodput": {n: c.get("whole", {}).get("goodput") for n, c in configs.items()}}
                     | ({"simulated_goodput": {n: c["simulated"]["whole"]["goodput"] for n, c in configs.items()
                                               if "simulated" in c}} if args.profile else {}))
    if interrupted:
        raise interrupted
    if record["errors"]:
        sys.exit("autoscale_bench: " + "; ".join(record["errors"]))


if __name__ == "__main__":
    sys.exit(lifecycle.run_main(main))
