"""``kvplan recommend``: search the configurations a device budget allows, find each one's
capacity, and recommend the best per device, with the runner-up, the GPU-seconds and the KV
bytes that explain it.

**Candidates** match the hardware:

- on a GPU profile, a worker is a device (the profile's tensor-parallel group: one GPU for the
  profiles shipped), and every candidate uses the budget (``--devices``): colocated x N with
  each chunk size of ``--chunks``, and prefill:decode splits P + D = N chunked at the largest
  chunk: a hill climb on capacity per device from the splits the GPU-seconds imply without and
  with prefix reuse (``planner.sizing``), in steps of N/16 then 1, that ends when the best
  split's neighbours are known (or exactly the shares of ``--prefill-shares``). A GPU's KV blocks are what its memory
  holds after the weights (``--device-memory``, default from the profile's device name); the
  trace runs at its native lengths;
- on a CPU profile, a worker takes ``--threads-per-worker`` CPUs: one colocated worker with
  every CPU, a fleet of smaller ones, and every split (or ``--prefill-shares``).

**Capacity** (``planner.capacity``): for each candidate the highest rate at which at least
``--attainment`` of its requests meet both objectives, found by bracketing from the GPU-seconds
estimate and bisecting to ``--precision`` (5%). Each point simulates the workload's first
``--search-requests`` open-loop requests at that rate (default: 30 per worker, at least 200, at
most the workload's), each on a fresh cluster after the workload's pre-warm; requests still
running when every request that could have met its objectives would have finished count as
missed.

**Objectives**, one pair for every candidate, stated in the report: fixed ones where given
(``--ttft-slo-ms``, ``--tpot-slo-ms``); else from unloaded probes on one worker: TTFT =
``--ttft-slo-mult`` x the unloaded TTFT, per prompt length for traces and request logs (a line
through probes at the median and the 90th-percentile prompt), and TPOT one bound for all
(``--tpot-slo-ms`` where given, else 100 ms on a GPU profile and ``--tpot-slo-mult`` x the
unloaded TPOT on a CPU one).

**Ranking**: by capacity per device. Candidates whose capacity intervals (``[capacity, upper)``
per device) reach the best one's are equivalent, and the simplest of them is recommended (one
pool before two, then fewer devices); the runner-up is the best of the rest, with its distance
in percent and why it stops (at its first failing rate, the share of requests that missed the
TTFT or the TPOT objective). Simulations are deterministic: the same inputs give the same answer.

**Commands**: each candidate's ``kvrouter up`` command names the profile's model (and
``--device=cuda`` on a GPU profile); where the profile describes hardware this machine cannot
start (a CUDA profile without a CUDA device here), ``command`` is null and ``note`` says so,
with the command for that hardware.

The workload: the load generator's flags (``planner.workload_args``), or ``--request-log``:
a router's request log (``kvrouter up --request-log``), replayed with its arrival times and
lengths; a request whose prompt was served partly from a cache gets that many leading tokens
in common with the last earlier request at least as long (the log keeps counts, not tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.profile.format import Profile
from planner.candidates import (
    Fleet,
    candidates,
    devices_of,
    gpu_colocated,
    gpu_split,
    next_splits,
    split_starts,
)
from planner.capacity import Capacity, SearchSettings, find_capacity
from planner.metrics import Slo, misses
from planner.sim.config import ClusterConfig, parse_bytes
from planner.sim.run import Profiles, simulate_point, unloaded
from planner.sim.sweep import at_rate
from planner.sim.worker import WorkerSpec
from planner.sizing import GpuSeconds, device_memory_gib, gpu_blocks, gpu_seconds, kv_bytes
from planner.sweep_args import add_objective_args
from planner.workload_args import build_workload, spec_from_args
from planner.workloads import BenchRequest, TokenSpace, Workload

__all__ = ["Objectives", "objectives", "rank", "recommend", "add_recommend_parser", "run_recommend",
           "workload_from_log"]

GPU_TPOT_S = 0.1            # the default TPOT objective on a GPU profile: 10 tokens/s a stream
GPU_STORE_GIB_PER_DEVICE = 128   # the store's host memory per GPU (a Mooncake-style DRAM pool)


# --- objectives ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Objectives:
    slo: Slo
    how: dict[str, str]          # how each objective was set, for the report

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.slo), **self.how}


def objectives(args: argparse.Namespace, profiles: Profiles, fleet: Fleet, workload: Workload,
               per_length: bool) -> Objectives:
    """One pair of objectives for every candidate (module docstring)."""
    ttft_fixed, tpot_fixed = args.ttft_slo_ms, args.tpot_slo_ms
    if ttft_fixed and tpot_fixed:
        slo = Slo(ttft_fixed / 1e3, tpot_fixed / 1e3, args.ttft_slo_per_token_ms / 1e3, args.ttft_slo_ref_tokens)
        return Objectives(slo, {"ttft": "fixed (--ttft-slo-ms)", "tpot": "fixed (--tpot-slo-ms)"})
    spec = WorkerSpec(role="colocated", threads=fleet.threads, block_size=fleet.block_size,
                      num_blocks=fleet.num_blocks,
                      max_num_seqs=fleet.max_num_seqs, max_model_len=fleet.max_model_len)
    one = ClusterConfig(name="probe", mode="colocated", prefill=0, decode=0, colocated=1, colocated_spec=spec,
                        store_memory_bytes=fleet.store_memory)
    space = spec_from_args(args, TokenSpace, "")
    long_prompt = workload.long_probe_prompt() if per_length else 0
    u = unloaded(one, profiles, space, workload.probe_shape(), args.unloaded_samples, args.seed, long_prompt)
    derived = u.slo(args.ttft_slo_mult, args.tpot_slo_mult)
    how = {"ttft": (f"{args.ttft_slo_mult:g} x the unloaded TTFT of one worker"
                    + (f", per prompt length (probes at {u.prompt_tokens} and {u.long_prompt_tokens} tokens)"
                       if u.long_prompt_tokens > u.prompt_tokens else f" at {u.prompt_tokens} prompt tokens"))}
    if ttft_fixed:
        ttft = Slo(ttft_fixed / 1e3, 1.0, args.ttft_slo_per_token_ms / 1e3, args.ttft_slo_ref_tokens)
        how["ttft"] = "fixed (--ttft-slo-ms)"
    else:
        ttft = derived
    if tpot_fixed:
        tpot, how["tpot"] = tpot_fixed / 1e3, "fixed (--tpot-slo-ms)"
    elif fleet.gpu:
        tpot, how["tpot"] = GPU_TPOT_S, f"fixed at {GPU_TPOT_S * 1e3:g} ms (the GPU default)"
    else:
        tpot, how["tpot"] = derived.tpot_s, f"{args.tpot_slo_mult:g} x the unloaded TPOT of one worker"
    return Objectives(Slo(ttft.ttft_s, tpot, ttft.ttft_per_token_s, ttft.ref_prompt_tokens), how)


# --- one candidate's capacity ----------------------------------------------------------------

def _grace_s(workload: Workload, slo: Slo) -> float:
    """After the last arrival, how long until every request that could meet its objectives has
    finished: the longest TTFT objective plus its stream at the TPOT objective."""
    return max(slo.ttft_objective(len(r.prompt)) + slo.tpot_s * max(r.max_tokens - 1, 0) for r in workload.requests)


class Search:
    """The simulated points of one candidate's capacity search."""

    def __init__(self, config: ClusterConfig, profiles: Profiles, base: Workload, slo: Slo, requests: int) -> None:
        self.config, self.profiles, self.base, self.slo, self.requests = config, profiles, base, slo, requests
        self.misses: dict[float, dict[str, int]] = {}
        self.computed: dict[float, tuple[int, int]] = {}   # rate -> (prompt tokens computed, prompt tokens)

    def attainment(self, rate: float) -> float:
        wl = at_rate(self.base, rate).truncate(self.requests)
        last = max((r.arrival_s for r in wl.requests if r.after is None), default=0.0)
        pt = simulate_point(self.config, self.profiles, wl, self.slo, max_duration_s=last + 1e-9,
                            grace_s=_grace_s(wl, self.slo))
        self.misses[rate] = misses(pt.run.results, self.slo)
        self.computed[rate] = (pt.run.computed_prompt_tokens, sum(len(r.prompt) for r in wl.requests))
        return pt.summary.attainment or 0.0

    def why(self, cap: Capacity) -> str:
        fail = cap.first_failure()
        if fail is None:
            return f"met the objectives at every rate tried (up to {cap.rate:.3g} req/s): its capacity lies higher"
        rate, att = fail
        m = self.misses.get(rate) or {}
        n = max(m.get("issued", 0), 1)
        ttft, tpot, failed = m.get("ttft", 0) / n, m.get("tpot", 0) / n, m.get("failed", 0) / n
        bound = "decode-bound" if tpot > ttft else "prefill-bound"
        return (f"{bound}: at {rate:.3g} req/s attainment {att:.0%}; {ttft:.0%} of requests missed the TTFT "
                f"objective, {tpot:.0%} the TPOT one" + (f", {failed:.0%} did not finish" if failed else ""))


# --- ranking ---------------------------------------------------------------------------------

def _pools(row: dict[str, Any]) -> int:
    return 1 if row["mode"] == "colocated" else 2


def rank(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any] | None, list[dict[str, Any]]]:
    """(recommended, runner-up, ranked) from candidate rows (module docstring). ``ranked`` is by
    capacity per device; each row gets ``equivalent`` (within the best one's uncertainty)."""
    ranked = sorted(rows, key=lambda r: (-r["capacity_per_device"], _pools(r), r["devices"], r["name"]))
    top = ranked[0]
    for r in ranked:
        upper = r["capacity_upper_per_device"]
        r["equivalent"] = r is top or r["capacity_per_device"] == top["capacity_per_device"] or (
            r["capacity_per_device"] > 0 and (upper is None or upper > top["capacity_per_device"]))
    best = min((r for r in ranked if r["equivalent"]),
               key=lambda r: (_pools(r), r["devices"], -r["capacity_per_device"], r["name"]))
    rest = [r for r in ranked if r is not best]
    return best, (rest[0] if rest else None), ranked


def _verdict(best: dict[str, Any], runner: dict[str, Any] | None, target: float) -> str:
    text = (f"{best['label']} ({best['name']}): {best['capacity_rps']:.3g} req/s at >= {target:.0%} attainment "
            f"on {best['devices']} devices, {best['capacity_per_device']:.3g} req/s per device")
    if best["uncertainty"] is not None:
        text += f" (+{best['uncertainty']:.0%} uncertain)"
    elif best["capacity_rps"] > 0:
        text += " (at least: no rate tried failed)"
    if runner:
        gap = runner["gap"]
        if runner["equivalent"]:
            text += (f"; {runner['label']} ({runner['name']}) is equivalent within the uncertainty "
                     f"({'the same' if abs(gap) < 0.005 else f'{-gap:+.0%}'} per device), and the simpler was chosen")
        else:
            text += f"; runner-up {runner['label']} ({runner['name']}) {gap:.0%} lower per device, {runner['why']}"
    return text


def recommend(cands: list[ClusterConfig], profiles: Profiles, base: Workload, slo: Slo, gpu: bool,
              guess: float, requests: int, search: SearchSettings = SearchSettings(),
              command: Any = None, on_candidate: Any = None, more: Any = None) -> dict[str, Any]:
    """Find every candidate's capacity and rank them (module docstring). ``guess``: the first
    rate tried per device; ``command(config) -> (command, note)``; ``more(rows) -> configs``:
    further candidates given the results so far (a search over splits), until it gives none."""
    command = command or (lambda c: (c.up_command(), None))
    rows: list[dict[str, Any]] = []
    queue = list(cands)
    while queue:
        c = queue.pop(0)
        n = devices_of(c, gpu)
        t0 = time.perf_counter()
        s = Search(c, profiles, base, slo, requests)
        cap = find_capacity(s.attainment, guess * n, search)
        cmd, note = command(c)
        computed = s.computed.get(cap.rate)
        row = {"name": c.name, "label": c.label(), "mode": c.mode, "prefill": c.prefill, "decode": c.decode,
               "devices": n, "capacity_rps": cap.rate, "capacity_upper_rps": cap.upper,
               "uncertainty": cap.uncertainty, "capacity_per_device": cap.rate / n,
               "capacity_upper_per_device": None if cap.upper is None else cap.upper / n,
               "why": s.why(cap), "command": cmd, **({"note": note} if note else {}),
               "points": [{"rate": r, "attainment": a, "misses": s.misses.get(r)} for r, a in sorted(cap.points)],
               "prompt_tokens_computed_share": (computed[0] / computed[1]) if computed and computed[1] else None,
               "search_seconds": time.perf_counter() - t0}
        rows.append(row)
        if on_candidate:
            on_candidate(row)
        if not queue and more is not None:
            queue = list(more(rows))
    best, runner, ranked = rank(rows)
    for r in ranked:
        r["gap"] = 1 - r["capacity_per_device"] / best["capacity_per_device"] if best["capacity_per_device"] else 0.0
    return {"best": best, "runner_up": runner, "equivalent": [r["name"] for r in ranked if r["equivalent"]],
            "verdict": _verdict(best, runner, search.target), "ranked": ranked}


def explain(gs: GpuSeconds, best: dict[str, Any], ranked: list[dict[str, Any]], devices: int) -> str:
    """Why the simulated best differs from (or agrees with) the split the GPU-seconds imply."""
    share, reused = gs.prefill_share, gs.prefill_share_reused
    said = (f"GPU-seconds imply {share:.0%} of the devices for prefill ({share * devices:.1f} of {devices}); "
            f"counting the workload's prefix reuse, {reused:.0%} ({reused * devices:.1f})")
    splits = [r for r in ranked if r["mode"] != "colocated"]
    if best["mode"] == "colocated":
        split = splits[0] if splits else None
        why = ("interference is cheaper than idle headroom: in one pool chunked prefill carries the decodes in its "
               "passes, and every device serves whichever phase has work")
        if split is not None:
            why += f"; the best split ({split['label']}) holds {split['gap']:.0%} less per device"
        return f"{said}. The simulated best is colocated: {why}."
    p = best["prefill"] / devices
    if abs(p - reused) * devices <= 1.0:
        cause = ("they agree once cache hits are counted" if abs(p - share) * devices > 1.0
                 else "they agree")
    elif p > reused:
        cause = ("queueing: prefill gets more than its share of the work, because long prompts queue behind each "
                 "other and the TTFT objective leaves prefill less room to run full than decode")
    else:
        cause = ("queueing: decode gets more than its share of the work, because the TPOT objective caps how large a "
                 "decode batch may grow under load")
    return f"{said}. The simulated best gives prefill {p:.0%} ({best['prefill']} of {devices}): {cause}."


# --- the request log as a workload -----------------------------------------------------------

def workload_from_log(path: str | Path, space: TokenSpace, seed: int = 0) -> Workload:
    """A router request log as a workload (module docstring)."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("status") == "ok" and r.get("prompt_tokens") and r.get("arrival_unix")]
    if not rows:
        raise ValueError(f"{path}: no finished requests in the log")
    rows.sort(key=lambda r: r["arrival_unix"])
    rng = np.random.default_rng([seed, 6])
    t0 = rows[0]["arrival_unix"]
    done: list[tuple[int, ...]] = []
    reqs = []
    for i, r in enumerate(rows):
        n = min(int(r["prompt_tokens"]), space.max_context - 1)
        pre, dec = r.get("prefill_stats") or {}, r.get("decode_stats") or {}
        hit = min(int(pre.get("device_hit_tokens", 0) or 0) + int(dec.get("device_hit_tokens", 0) or 0)
                  + int(pre.get("store_hit_tokens", 0) or 0), n - 1)
        prefix: tuple[int, ...] = ()
        if hit > 0:
            prefix = next((p[:hit] for p in reversed(done) if len(p) >= hit), ())
        prompt = prefix + space.random(rng, n - len(prefix))
        done.append(prompt)
        out = max(1, min(int(r.get("output_tokens") or 1), space.max_context - n))
        reqs.append(BenchRequest(f"log-{i}", prompt, out, r["arrival_unix"] - t0, tag="log"))
    return Workload("request_log", reqs, scaling={"source": str(path), "requests": len(reqs)})


# --- the command line ------------------------------------------------------------------------

def add_recommend_parser(sub: Any) -> None:
    r = sub.add_parser("recommend", help="search the configurations a budget allows; recommend the best",
                       description=(__doc__ or "").split("\n")[0])
    r.add_argument("--devices", type=int, required=True,
                   help="the budget: CPUs (CPU profiles) or GPUs (GPU profiles)")
    r.add_argument("--threads-per-worker", type=int, default=1,
                   help="CPU profiles: threads (CPUs) of each worker in a fleet (default 1)")
    r.add_argument("--chunks", default=None,
                   help="per-step token budgets to try; 0 is chunked prefill off (default 0,256,2048 on a CPU "
                        "profile, 2048,8192 on a GPU one)")
    r.add_argument("--num-blocks", type=int, default=None,
                   help="device KV blocks of the whole fleet on a CPU budget (default 512), of each GPU on a GPU "
                        "one (default: what --device-memory holds after the weights)")
    r.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default 16 on a CPU profile, 64 on a GPU one: the simulation's "
                        "cost is per block)")
    r.add_argument("--device-memory", type=float, default=None,
                   help="GPU profiles: one GPU's memory in GiB (default: from the profile's device name, else 80)")
    r.add_argument("--max-num-seqs", type=int, default=None,
                   help="each worker's most running requests (default 64 on a CPU profile, 256 on a GPU one)")
    r.add_argument("--prefill-shares", default=None,
                   help="try only the splits with these prefill shares of the workers, e.g. 0.25,0.5,0.75 "
                        "(default: every split on a CPU profile; on a GPU one, a search from the GPU-seconds' splits)")
    r.add_argument("--store-memory", default=None,
                   help=f"the store's memory (default 2G on a CPU profile, {GPU_STORE_GIB_PER_DEVICE} GiB per GPU "
                        "on a GPU one)")
    r.add_argument("--policy", default="kv-aware", help="the router's prefill policy (default kv-aware)")
    r.add_argument("--attainment", type=float, default=0.9,
                   help="the attainment a rate must keep to count (default 0.9)")
    r.add_argument("--precision", type=float, default=0.05,
                   help="the capacity search stops when its bracket is this narrow, relatively (default 0.05)")
    r.add_argument("--search-requests", type=int, default=None,
                   help="requests a search point simulates (default: 30 per worker, at least 200, at most the "
                        "workload's)")
    r.add_argument("--link-gbps", type=float, default=200.0,
                   help="the prefill-to-decode link for the KV transfer time, Gb/s (default 200: one RDMA NIC)")
    r.add_argument("--max-workers", type=int, default=64, help="CPU profiles: the most workers a candidate may have")
    r.add_argument("--max-colocated", type=int, default=0,
                   help="CPU profiles: the most workers of a colocated fleet; 1 for what `kvrouter up` runs "
                        "(default: no cap)")
    r.add_argument("--request-log", default=None,
                   help="replay a router request log instead of --workload (arrivals and lengths as logged)")
    r.add_argument("--no-progress", action="store_true", help="no per-candidate lines on stderr")
    add_objective_args(r, sweep=False)
    # Left unset, these follow the hardware (run_recommend): a GPU profile runs the trace at its
    # native lengths in a long context.
    r.set_defaults(trace_scale=None, max_context=None)


def _fleet(args: argparse.Namespace, profile: Profile, gpu: bool) -> Fleet:
    if gpu:
        block = args.block_size or 64
        memory = args.device_memory or device_memory_gib(profile)
        blocks = args.num_blocks or gpu_blocks(profile, block, memory)
        store = parse_bytes(args.store_memory) if args.store_memory else args.devices * GPU_STORE_GIB_PER_DEVICE << 30
        return Fleet(True, args.devices, 1, blocks, block, args.max_num_seqs or 256, args.max_context, store, memory)
    return Fleet(False, args.devices, args.threads_per_worker, args.num_blocks or 512, args.block_size or 16,
                 args.max_num_seqs or 64, args.max_context, parse_bytes(args.store_memory or "2G"))


def _cuda_here() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def run_recommend(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    profiles = Profiles.from_files(args.profile)
    profile = profiles.profiles[0]
    gpu = all(p.hardware.device == "cuda" for p in profiles.profiles)
    if args.trace_scale is None:
        args.trace_scale = 1 if gpu else 32
    if args.max_context is None:
        args.max_context = 131072 if gpu else 2048
    fleet = _fleet(args, profile, gpu)
    chunks = [int(c) for c in (args.chunks or ("2048,8192" if gpu else "0,256,2048")).split(",")]
    shares = [float(x) for x in args.prefill_shares.split(",")] if args.prefill_shares else None
    space = spec_from_args(args, TokenSpace, "")
    if args.request_log:
        base = workload_from_log(args.request_log, space, args.seed)
    else:
        base = build_workload(args, None if args.workload == "trace" else 1.0, args.seed * 1000)
    per_length = args.ttft_slo_per_length or args.request_log is not None or args.workload == "trace"
    obj = objectives(args, profiles, fleet, base, per_length)
    spec = WorkerSpec(threads=fleet.threads, block_size=fleet.block_size)
    costs = profiles.costs_for(spec)
    kv_per_device = fleet.num_blocks * fleet.block_size // (1 if gpu else max(fleet.devices // fleet.threads, 1))
    gs = gpu_seconds(costs, base, max(chunks), obj.slo.tpot_s, fleet.max_num_seqs, kv_per_device)
    more: Callable[[list[dict[str, Any]]], list[ClusterConfig]] | None = None
    if gpu:
        chunk = max(chunks)
        starts = split_starts(fleet.devices, shares or [gs.prefill_share, gs.prefill_share_reused])
        cands = gpu_colocated(fleet, chunks, args.policy, args.salt_per_request) + [
            gpu_split(fleet, p, chunk, args.policy, args.salt_per_request) for p in starts]

        def climb(rows: list[dict[str, Any]]) -> list[ClusterConfig]:
            return [gpu_split(fleet, p, chunk, args.policy, args.salt_per_request)
                    for p in next_splits(rows, fleet.devices)]

        more = None if shares else climb
    else:   # every CPU candidate is listed up front
        cands = candidates(args.devices, args.threads_per_worker, chunks, fleet.num_blocks, fleet.max_model_len,
                           fleet.store_memory, args.policy, args.salt_per_request, args.max_workers, shares,
                           max_num_seqs=fleet.max_num_seqs, max_colocated=args.max_colocated,
                           block_size=fleet.block_size)
    roots = sum(1 for r in base.requests if r.after is None)
    workers = max(c.workers for c in cands)
    requests = args.search_requests or min(roots, max(200, 30 * workers))
    # The first rate tried per device: what one device serves with every second busy, on a GPU;
    # a CPU worker's threads share its work, so per CPU that is per worker over its threads.
    guess = gs.capacity_guess(1) / (1 if gpu else fleet.threads)
    model = profile.model.name if gpu else "default"
    cuda = _cuda_here() if gpu else False

    def command(c: ClusterConfig) -> tuple[str | None, str | None]:
        cmd = c.up_command(model=model, device="cuda" if gpu else None)
        if gpu and not cuda:
            return None, (f"the profile describes {profile.model.name} on {profile.hardware.device_name}; this "
                          f"machine has no CUDA device to start it on. On that hardware: {cmd}")
        return cmd, None

    say = None if args.no_progress else (lambda row: print(
        f"[kvplan] {row['name']}: {row['capacity_rps']:.3g} req/s on {row['devices']} devices "
        f"({row['capacity_per_device']:.3g} per device; {len(row['points'])} points, "
        f"{row['search_seconds']:.0f} s)", file=sys.stderr))
    out = recommend(cands, profiles, base, obj.slo, gpu, guess, requests,
                    SearchSettings(args.attainment, args.precision), command, say, more)
    ratio = {**gs.to_json(), "implied_prefill_devices": gs.prefill_share * fleet.devices,
             "simulated_best": out["best"]["label"],
             "explanation": explain(gs, out["best"], out["ranked"], fleet.devices)}
    rec = {"bench": "kvplan-recommend", "simulated": True, "profiles": profiles.describe(),
           "devices": args.devices, "hardware": "gpu" if gpu else "cpu", "fleet": fleet.describe(),
           "tensor_parallel": 1, "workload": "request_log" if args.request_log else args.workload,
           "workload_scaling": {k: v for k, v in base.scaling.items() if k != "space"},
           "objectives": obj.to_json(),
           "search": {"requests_per_point": requests, "attainment": args.attainment, "precision": args.precision,
                      "first_rate_per_device": guess},
           "gpu_seconds": ratio,
           "kv_bytes": kv_bytes(base, profile.model.kv_bytes_per_token, args.link_gbps).to_json(),
           "candidates": len(cands), **out, "seconds": time.perf_counter() - t0}
    if args.out:
        path = Path(args.out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "recommend.json").write_text(json.dumps(rec, indent=1))
    print(out["verdict"], file=sys.stderr)
    print(f"GPU-seconds: {ratio['explanation']}", file=sys.stderr)
    best = out["best"]
    print(f"run it: {best['command']}" if best["command"] else f"to run it: {best['note']}", file=sys.stderr)
    return rec
