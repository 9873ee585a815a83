"""``kvplan recommend``: search the configurations a device budget allows, simulate each, and
recommend the best by goodput per device, with the runner-up and why.

The search (DistServe's placement search, on one node): every colocated fleet and every
prefill:decode split whose workers fit the budget (``--devices``: CPUs or GPUs; a worker takes
``--threads-per-worker`` of them on a CPU profile, one GPU on a GPU profile), with each chunk
size of ``--chunks`` (``0``: chunked prefill off, colocated only). Each candidate is simulated
over ``--rates`` (``planner.sim.sweep``: the sweep's points and objectives), and scored by its
**goodput per device**: the highest rate at which it still meets the objectives for at least
``--attainment`` of its requests (interpolated, ``max_rate_90``), over the devices it uses.
Objectives are the first candidate's unloaded latency times the multipliers (as
``benchmarks.serving.compare`` fixes them from its first configuration), or fixed ones.

Why one loses: at the first rate it misses the target, whether its requests missed the TTFT
objective or the TPOT one more often (a prefill-bound or a decode-bound shape).

The workload: the load generator's flags (``planner.workload_args``), or ``--request-log``:
a router's request log (``kvrouter up --request-log``), replayed with its arrival times and
lengths; a request whose prompt was served partly from a cache gets that many leading tokens
in common with the last earlier request at least as long (the log keeps counts, not tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from planner.metrics import Slo, Unloaded
from planner.sim.config import ClusterConfig, parse_bytes
from planner.sim.run import Profiles
from planner.sim.sweep import SweepSettings, simulate_config
from planner.sim.worker import WorkerSpec
from planner.sweep_args import add_objective_args, settings_from_args
from planner.workloads import BenchRequest, TokenSpace, Workload

__all__ = ["candidates", "recommend", "add_recommend_parser", "run_recommend", "workload_from_log"]


def candidates(devices: int, threads: int, chunks: list[int], num_blocks: int, max_model_len: int,
               store_memory: int, policy: str = "kv-aware", salt: bool = False,
               max_workers: int = 64, prefill_shares: list[float] | None = None,
               per_worker_blocks: bool = False, max_num_seqs: int = 64,
               max_colocated: int = 0, block_size: int = 16) -> list[ClusterConfig]:
    """Every configuration that fits ``devices`` (module docstring); KV blocks are split
    evenly, so each candidate holds ``num_blocks`` device blocks in all (``per_worker_blocks``:
    each worker holds ``num_blocks``, as a GPU's memory does). ``prefill_shares`` limits the
    splits to those prefill shares of the workers (rounded; default every split);
    ``max_colocated`` > 0 caps the colocated fleets' size (``kvrouter up`` starts one)."""
    out: list[ClusterConfig] = []
    slots = min(devices // threads, max_workers)
    if slots < 1:
        raise ValueError(f"{devices} devices cannot hold one worker of {threads} threads")
    for chunk in chunks:
        base = WorkerSpec(max_model_len=max_model_len, max_num_batched_tokens=chunk or 2048,
                          enable_chunked_prefill=chunk > 0, max_num_seqs=max_num_seqs, block_size=block_size)
        share = (lambda k: num_blocks) if per_worker_blocks else (lambda k: num_blocks // k)
        tag = f"chunk{chunk}" if chunk else "nochunk"
        # One colocated worker with every device, and fleets of smaller ones.
        for k in sorted({1, slots} if not max_colocated else {1, min(slots, max_colocated)}):
            t = devices if k == 1 else threads
            spec = dataclasses.replace(base, role="colocated", threads=t, num_blocks=share(k))
            out.append(ClusterConfig(name=f"colo{k}x{t}t_{tag}", mode="colocated", prefill=0, decode=0,
                                     colocated=k, colocated_spec=spec, policy=policy,
                                     store_memory_bytes=store_memory, salt_per_request=salt))
        if chunk == 0:
            continue
        splits = range(1, slots) if prefill_shares is None else sorted(
            {min(max(round(f * slots), 1), slots - 1) for f in prefill_shares} if slots > 1 else set())
        for p in splits:
            d = slots - p
            each = share(p + d)
            out.append(ClusterConfig(
                name=f"split{p}p{d}d_{tag}", mode="disaggregated", prefill=p, decode=d,
                prefill_spec=dataclasses.replace(base, role="prefill", threads=threads, num_blocks=each),
                decode_spec=dataclasses.replace(base, role="decode", threads=threads, num_blocks=each),
                policy=policy, store_memory_bytes=store_memory, salt_per_request=salt))
    return out


def devices_of(c: ClusterConfig, gpu: bool) -> int:
    return c.workers if gpu else sum(s.threads for s in c.specs())


def _why(rec: dict[str, Any], target: float) -> str:
    """Why a configuration stops at its rate: at the first rate below ``target``, the share of
    requests that missed the TTFT objective, the TPOT one, or failed."""
    for p in rec["points"]:
        s = p["summary"]
        if s["attainment"] < target:
            m = p.get("misses") or {}
            n = max(m.get("issued", 0), 1)
            ttft, tpot, failed = m.get("ttft", 0) / n, m.get("tpot", 0) / n, m.get("failed", 0) / n
            bound = "decode-bound" if tpot > ttft else "prefill-bound"
            return (f"{bound}: at {p['rate']:g} req/s attainment {s['attainment']:.0%}; "
                    f"{ttft:.0%} of requests missed the TTFT objective, {tpot:.0%} the TPOT one"
                    + (f", {failed:.0%} did not finish" if failed else ""))
    return f"meets the objectives at every rate tried (up to {rec['points'][-1]['rate']:g} req/s)"


def recommend(cands: list[ClusterConfig], profiles: Profiles, args: argparse.Namespace, s: SweepSettings,
              gpu: bool, target: float = 0.9, workload: Workload | None = None,
              on_candidate: Any = None) -> dict[str, Any]:
    """Simulate every candidate and rank them (module docstring)."""
    ranked: list[dict[str, Any]] = []
    ref: Unloaded | None = None
    for c in cands:
        rec = simulate_config(c, profiles, args, s, ref, workload=workload)
        if ref is None:
            ref = Unloaded(**rec["unloaded"])
        if s.fixed_slo is None and ref is not None:
            s = dataclasses.replace(s, fixed_slo=Slo(**rec["slo"]))  # every candidate, one objective
        rate = rec["max_rate_90"]["interpolated"] or 0.0
        n = devices_of(c, gpu)
        row = {"name": c.name, "label": c.label(), "devices": n, "max_rate_90": rate,
               "goodput_per_device": rate / n, "why": _why(rec, target), "command": c.up_command(),
               "curve": [{"rate": p["rate"], "attainment": p["summary"]["attainment"],
                          "goodput": p["summary"]["goodput"],
                          "ttft_p90": (p["summary"]["ttft_s"] or {}).get("p90"),
                          "tpot_p90": (p["summary"]["tpot_s"] or {}).get("p90"),
                          "attainment_at_scale": p["attainment_at_scale"]} for p in rec["points"]],
               "slo": rec["slo"]}
        ranked.append(row)
        if on_candidate:
            on_candidate(row)
    # Ties (none reached the target at any rate: all 0) go to the best attainment at the
    # lowest rate, then the fewer devices.
    ranked.sort(key=lambda r: (-r["goodput_per_device"], -r["curve"][0]["attainment"], r["devices"], r["name"]))
    best, runner = ranked[0], (ranked[1] if len(ranked) > 1 else None)
    verdict = (f"{best['label']} ({best['name']}): {best['max_rate_90']:.3g} req/s at >= {target:.0%} "
               f"attainment on {best['devices']} devices, {best['goodput_per_device']:.3g} req/s per device")
    if runner:
        gap = (1 - runner["goodput_per_device"] / best["goodput_per_device"]) if best["goodput_per_device"] else 0.0
        verdict += (f"; runner-up {runner['label']} ({runner['name']}) {gap:.0%} lower per device, "
                    f"{runner['why']}")
    return {"best": best, "runner_up": runner, "verdict": verdict, "ranked": ranked}


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
        tok = r.get("tokens") or {}
        hit = min(int(tok.get("device_hit", 0) or 0) + int(tok.get("store_hit", 0) or 0), n - 1)
        prefix: tuple[int, ...] = ()
        if hit > 0:
            prefix = next((p[:hit] for p in reversed(done) if len(p) >= hit), ())
        prompt = prefix + space.random(rng, n - len(prefix))
        done.append(prompt)
        out = max(1, min(int(r.get("output_tokens") or 1), space.max_context - n))
        reqs.append(BenchRequest(f"log-{i}", prompt, out, r["arrival_unix"] - t0, tag="log"))
    return Workload("request_log", reqs, scaling={"source": str(path), "requests": len(reqs)})


def add_recommend_parser(sub: Any) -> None:
    r = sub.add_parser("recommend", help="search the configurations a budget allows; recommend the best",
                       description=(__doc__ or "").split("\n")[0])
    r.add_argument("--devices", type=int, required=True,
                   help="the budget: CPUs (CPU profiles) or GPUs (GPU profiles)")
    r.add_argument("--threads-per-worker", type=int, default=1,
                   help="CPU profiles: threads (CPUs) of each worker in a fleet (default 1)")
    r.add_argument("--chunks", default="0,256,2048",
                   help="per-step token budgets to try; 0 is chunked prefill off (default %(default)s)")
    r.add_argument("--num-blocks", type=int, default=512,
                   help="device KV blocks of the whole fleet on a CPU budget, of each GPU on a GPU one (default 512)")
    r.add_argument("--max-num-seqs", type=int, default=64, help="each worker's most running requests (default 64)")
    r.add_argument("--prefill-shares", default=None,
                   help="try only the splits with these prefill shares of the workers, e.g. 0.25,0.5,0.75 "
                        "(default: every split)")
    r.add_argument("--store-memory", default="2G", help="the store's memory (default 2G)")
    r.add_argument("--policy", default="kv-aware", help="the router's prefill policy (default kv-aware)")
    r.add_argument("--attainment", type=float, default=0.9,
                   help="the attainment a rate must keep to count (default 0.9)")
    r.add_argument("--max-workers", type=int, default=64, help="the most workers a candidate may have")
    r.add_argument("--max-colocated", type=int, default=0,
                   help="the most workers of a colocated fleet; 1 for what `kvrouter up` runs (default: no cap)")
    r.add_argument("--request-log", default=None,
                   help="replay a router request log instead of --workload (arrivals and lengths as logged)")
    r.add_argument("--no-progress", action="store_true", help="no per-candidate lines on stderr")
    add_objective_args(r)


def run_recommend(args: argparse.Namespace) -> dict[str, Any]:
    import sys

    profiles = Profiles.from_files(args.profile)
    gpu = all(p.hardware.device == "cuda" for p in profiles.profiles)
    chunks = [int(c) for c in args.chunks.split(",")]
    shares = [float(x) for x in args.prefill_shares.split(",")] if args.prefill_shares else None
    cands = candidates(args.devices, 1 if gpu else args.threads_per_worker, chunks, args.num_blocks,
                       args.max_context, parse_bytes(args.store_memory), args.policy, args.salt_per_request,
                       args.max_workers, shares, per_worker_blocks=gpu, max_num_seqs=args.max_num_seqs,
                       max_colocated=args.max_colocated)
    s = settings_from_args(args)
    workload = None
    if args.request_log:
        from planner.workload_args import spec_from_args

        workload = workload_from_log(args.request_log, spec_from_args(args, TokenSpace, ""), args.seed)
    say = None if args.no_progress else (lambda row: print(
        f"[kvplan] {row['name']}: {row['max_rate_90']:.3g} req/s on {row['devices']} devices "
        f"({row['goodput_per_device']:.3g} per device)", file=sys.stderr))
    out = recommend(cands, profiles, args, s, gpu, args.attainment, workload, say)
    rec = {"bench": "kvplan-recommend", "simulated": True, "profiles": profiles.describe(),
           "devices": args.devices, "workload": "request_log" if workload else args.workload,
           "candidates": len(cands), **out}
    if args.out:
        path = Path(args.out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "recommend.json").write_text(json.dumps(rec, indent=1))
    print(out["verdict"], file=sys.stderr)
    print(f"run it: {out['best']['command']}", file=sys.stderr)
    return rec

