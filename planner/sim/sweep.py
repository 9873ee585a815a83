"""A simulated ``benchmarks.serving.sweep``: the same points, the same objectives, the same record.

For each configuration: the unloaded probes (``planner.sim.run.unloaded``) give the objectives
(``--ttft-slo-mult`` x the unloaded TTFT, per prompt length with ``--ttft-slo-per-length``,
``--tpot-slo-mult`` x the unloaded TPOT; from the first configuration's probes with
``slo_ref="first"``), unless fixed ones are given. Then one point per rate: the workload the
flags describe at that rate with seed ``1000 * seed + i``, cut to the requests the point has
time for (``ceil(rate x 0.75 x point_seconds)``), sent for 3/4 of the point and cancelled at
its end, each point on a fresh cluster with its pre-warm first. The record has the shape of
``benchmarks.serving.sweep``'s per-configuration results (``unloaded``, ``slo``, ``max_rate_90``,
``points`` with ``summary``), so the same reports read both.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from planner.metrics import SLO_SCALES, Slo, Unloaded, attainment_at_scales, max_rate_meeting, misses
from planner.sim.config import ClusterConfig
from planner.sim.run import Profiles, simulate_point, unloaded
from planner.workload_args import build_workload, spec_from_args
from planner.workloads import TokenSpace, Workload

__all__ = ["SweepSettings", "simulate_config", "simulate_sweep"]


@dataclasses.dataclass(frozen=True)
class SweepSettings:
    rates: tuple[float, ...]
    point_seconds: float = 60.0
    unloaded_samples: int = 3
    ttft_slo_mult: float = 5.0
    tpot_slo_mult: float = 2.0
    ttft_slo_per_length: bool = False
    slo_ref: str = "first"          # "first" configuration's probes, or each one's "own"
    fixed_slo: Slo | None = None
    prewarm_concurrency: int = 4


_BUILT: dict[tuple[Any, ...], Workload] = {}


def _workload(args: argparse.Namespace, rate: float, seed: int) -> Workload:
    """``build_workload``, remembered: every candidate of a search runs the same points, and a
    native-scale trace takes seconds to synthesize. Simulations never modify a workload."""
    key = (tuple(sorted((k, repr(v)) for k, v in vars(args).items())), rate, seed)
    wl = _BUILT.get(key)
    if wl is None:
        if len(_BUILT) >= 16:
            _BUILT.pop(next(iter(_BUILT)))
        wl = _BUILT[key] = build_workload(args, rate, seed)
    return wl


def at_rate(workload: Workload, rate: float) -> Workload:
    """``workload`` with its open-loop arrivals scaled to a mean of ``rate`` per second."""
    arrivals = [r.arrival_s for r in workload.requests if r.after is None]
    span = max(arrivals) - min(arrivals) if len(arrivals) > 1 else 0.0
    if span <= 0:
        return workload
    k = (len(arrivals) - 1) / span / rate
    reqs = [dataclasses.replace(r, arrival_s=r.arrival_s * k) for r in workload.requests]
    return dataclasses.replace(workload, requests=reqs)


def simulate_config(config: ClusterConfig, profiles: Profiles, args: argparse.Namespace,
                    s: SweepSettings, ref: Unloaded | None = None,
                    on_point: Callable[[dict[str, Any]], None] | None = None,
                    workload: Workload | None = None) -> dict[str, Any]:
    """One configuration's sweep, simulated (module docstring); ``args`` holds the workload
    flags (``planner.workload_args``). A given ``workload`` (a replayed log) is used instead,
    its arrivals rescaled to each rate."""
    t0 = time.perf_counter()
    space = spec_from_args(args, TokenSpace, "")
    rates = sorted(s.rates)
    first = workload or _workload(args, rates[0], args.seed * 1000)
    long_prompt = first.long_probe_prompt() if s.ttft_slo_per_length else 0
    u = unloaded(config, profiles, space, first.probe_shape(), s.unloaded_samples, args.seed, long_prompt)
    slo = s.fixed_slo or (ref if s.slo_ref == "first" and ref else u).slo(s.ttft_slo_mult, s.tpot_slo_mult)
    sending = 0.75 * s.point_seconds
    points = []
    for i, rate in enumerate(rates):
        seed = 1000 * args.seed + i
        n = max(1, math.ceil(rate * sending))
        if workload is not None:
            wl = at_rate(workload, rate).truncate(n)
        elif args.workload == "mixed":
            wl = _workload(argparse.Namespace(**{**vars(args), "num_requests": min(n, args.num_requests or n)}),
                           rate, seed)
        else:
            wl = _workload(args, rate, seed).truncate(n)
        pt = simulate_point(config, profiles, wl, slo, max_duration_s=sending,
                            grace_s=s.point_seconds - sending, prewarm_concurrency=s.prewarm_concurrency)
        res = pt.run.results
        rec = {"config": config.name, "rate": rate, "workload": wl.name, "requests": len(wl.requests),
               "not_sent": pt.run.not_sent, "summary": pt.summary.to_json(), "misses": misses(res, slo),
               "attainment_at_scale": attainment_at_scales(pt.run.results, slo, SLO_SCALES),
               "sim": {"routes": pt.run.routes, "worker_busy_s": pt.run.worker_busy_s,
                       "worker_steps": pt.run.worker_steps, "events": pt.run.events,
                       "device_hit_tokens": pt.run.device_hit_tokens,
                       "store_hit_tokens": pt.run.store_hit_tokens,
                       "computed_prompt_tokens": pt.run.computed_prompt_tokens,
                       "prewarm_sent": len(wl.prewarm),
                       **({"autoscale_actions": pt.run.autoscale_actions} if config.autoscale else {})}}
        points.append(rec)
        if on_point:
            on_point(rec)
    return {"config": config.name, "label": config.label(), "command": config.up_command(),
            "unloaded": dataclasses.asdict(u), "slo": dataclasses.asdict(slo),
            "max_rate_90": max_rate_meeting(points), "points": points,
            "sim_seconds": time.perf_counter() - t0}


def simulate_sweep(configs: Sequence[ClusterConfig], profiles: Profiles, args: argparse.Namespace,
                   s: SweepSettings, on_point: Callable[[dict[str, Any]], None] | None = None
                   ) -> Mapping[str, dict[str, Any]]:
    """Every configuration's sweep; objectives from the first one's probes unless ``slo_ref``
    is ``own`` or fixed objectives are given."""
    out: dict[str, dict[str, Any]] = {}
    ref: Unloaded | None = None
    for c in configs:
        rec = simulate_config(c, profiles, args, s, ref, on_point)
        if ref is None:
            ref = Unloaded(**rec["unloaded"])
        out[c.name] = rec
    return out
