"""Simulated runs: a point (pre-warm, then a workload under the load generator's time bounds),
unloaded probes (the sweep's objectives), and the profiles each worker's step costs come from.

- :class:`Profiles`: one or more ``kvengine profile`` files; a worker gets the profile measured
  with its own thread count (``WorkerSpec.threads``), else the nearest. A CPU worker with one
  thread is not half a worker with two (nor is one with two twice one with one): profile each.
- :func:`simulate_point`: a fresh cluster, the pre-warm sent untimed (``prewarm_concurrency`` in
  flight, as ``benchmarks.serving.serve_bench.run_point`` does), then the workload, summarized with
  ``planner.metrics.summarize``: the same figures the benchmarks print.
- :func:`unloaded`: ``benchmarks.serving.serve_bench.measure_unloaded``'s probes (one warm-up, then
  ``n`` requests of the workload's typical shape one at a time, fresh tokens each; optionally
  as many of the long probe), on a fresh cluster: its medians give the objectives.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.profile.format import Profile, load
from planner.metrics import Slo, Summary, Unloaded, summarize
from planner.sim.cluster import RunResult, SimCluster
from planner.sim.config import ClusterConfig
from planner.sim.costs import StepCosts
from planner.sim.worker import WorkerSpec
from planner.workloads import BenchRequest, TokenSpace, Workload

__all__ = ["Profiles", "PointOutcome", "simulate_point", "unloaded", "run_requests"]


class Profiles:
    """Step costs per thread count (see the module docstring)."""

    def __init__(self, profiles: Sequence[Profile]) -> None:
        if not profiles:
            raise ValueError("need at least one profile")
        shapes = {(p.model.num_layers, p.model.block_bytes) for p in profiles}
        if len(shapes) > 1:
            raise ValueError(f"profiles of different models: {sorted(shapes)}")
        self.by_threads = {p.hardware.threads: p for p in profiles}
        self.profiles = list(profiles)
        self._costs: dict[tuple[int, int], StepCosts] = {}

    @classmethod
    def from_files(cls, paths: Sequence[str | Path]) -> Profiles:
        return cls([load(p) for p in paths])

    def costs_for(self, spec: WorkerSpec) -> StepCosts:
        t = min(self.by_threads, key=lambda k: (abs(k - spec.threads), -k))
        key = (t, spec.block_size)
        if key not in self._costs:
            self._costs[key] = StepCosts(self.by_threads[t], spec.block_size)
        return self._costs[key]

    def describe(self) -> list[str]:
        return [f"{p.model.name} on {p.hardware.device_name} ({p.hardware.device}, "
                f"{p.hardware.threads} thread{'s' if p.hardware.threads != 1 else ''}, "
                f"created {p.created})" + _serving(p) for p in self.profiles]


def _serving(p: Profile) -> str:
    sv = p.serving
    if sv is None:
        return "; no serving section (the engine alone)"
    return (f"; serving stack measured {sv.created}: hop {sv.hop_s * 1e3:.1f} ms, "
            f"+{sv.step_s * 1e3:.2f} ms a decode step, +{sv.token_s * 1e3:.2f} ms a streamed token")


@dataclass
class PointOutcome:
    run: RunResult
    summary: Summary
    prewarm: RunResult | None


def run_requests(config: ClusterConfig, profiles: Profiles, requests: Sequence[BenchRequest], *,
                 prewarm: Sequence[BenchRequest] = (), prewarm_concurrency: int = 4,
                 max_duration_s: float = math.inf, grace_s: float = 0.0) -> tuple[RunResult, RunResult | None]:
    cluster = SimCluster(config, profiles.costs_for)
    warm = None
    if prewarm:
        warm = cluster.run_workload(prewarm, max_concurrency=prewarm_concurrency)
    run = cluster.run_workload(requests, max_duration_s=max_duration_s, grace_s=grace_s)
    return run, warm


def simulate_point(config: ClusterConfig, profiles: Profiles, workload: Workload, slo: Slo | None, *,
                   max_duration_s: float = math.inf, grace_s: float = 0.0,
                   prewarm_concurrency: int = 4) -> PointOutcome:
    """One point of a sweep, simulated (see the module docstring)."""
    run, warm = run_requests(config, profiles, workload.requests, prewarm=workload.prewarm,
                             prewarm_concurrency=prewarm_concurrency,
                             max_duration_s=max_duration_s, grace_s=grace_s)
    duration = run.duration_s if run.duration_s > 0 else 1e-9
    return PointOutcome(run, summarize(run.results, duration, slo), warm)


def _one_at_a_time(config: ClusterConfig, profiles: Profiles, space: TokenSpace, shape: tuple[int, int],
                   n: int, seed: int, tag: str, warmup: int) -> list:
    rng = np.random.default_rng([seed, 4, shape[0]])
    reqs = [BenchRequest(f"{tag}-{seed}-{i}", space.random(rng, shape[0]), shape[1], tag="unloaded")
            for i in range(warmup + n)]
    cluster = SimCluster(config, profiles.costs_for)
    run = cluster.run_workload(reqs, max_concurrency=1)
    byid = {r.request_id: r for r in run.results}
    out = [byid[r.request_id] for r in reqs[warmup:] if r.request_id in byid and byid[r.request_id].ok]
    if not out:
        raise RuntimeError(f"simulated unloaded probes of {shape[0]} tokens failed: "
                           f"{[r.error for r in run.results][:3]}")
    return out


def unloaded(config: ClusterConfig, profiles: Profiles, space: TokenSpace, shape: tuple[int, int],
             n: int = 3, seed: int = 0, long_prompt: int = 0) -> Unloaded:
    """The sweep's unloaded probes, simulated (see the module docstring)."""
    measured = _one_at_a_time(config, profiles, space, shape, n, seed, "unloaded", warmup=1)
    u = Unloaded(shape[0], shape[1], statistics.median(r.ttft_s for r in measured),
                 statistics.median(r.tpot_s for r in measured if r.tpot_s is not None), len(measured))
    if long_prompt > shape[0]:
        longs = _one_at_a_time(config, profiles, space, (long_prompt, 2), n, seed, "unloaded-long", 0)
        u = Unloaded(u.prompt_tokens, u.max_tokens, u.ttft_s, u.tpot_s, u.samples,
                     long_prompt, statistics.median(r.ttft_s for r in longs))
    return u
