"""What the serving stack adds to the engine's own times: a profile's ``serving`` section.

    python -m benchmarks.planner.stack_profile --profile results/profile_t2.json [--model default]

``kvengine profile`` times the engine alone. A request served for real also crosses HTTP
twice, the router forwards every streamed token, the client parses it, and on a small machine
the router, the client, the store daemon and etcd take CPU from the workers. A simulator
calibrated from the engine alone is optimistic by that much. This command measures it, from
requests of its own (never the runs a simulation is later checked against):

1. it starts the real stack with ``kvrouter up`` in the layout the profile's thread count
   fills the machine with (``--up``; by default one colocated worker of two threads, or one
   prefill and one decode worker of one thread each, ``benchmarks.serving.compare``'s layouts);
2. it sends seeded requests through the benchmarks' streaming client (``load_client``):
   ``hops`` unloaded requests one after another (a ``hop_prompt``-token prompt, 2 tokens
   out), then, per batch size ``b`` in ``batches``, ``rounds`` rounds of ``b`` requests at
   once (``prompt`` tokens in, ``output`` out, distinct prompts: no prefix reuse);
3. it sends the same requests, the same way, through the simulator (``planner.sim``) with the
   profile's engine curves and no serving cost;
4. the difference is the serving cost: ``hop_s`` is a third of the median TTFT difference of
   the unloaded requests (a first token is three messages: client -> router -> worker ->
   router -> client, counted as three hops), and ``step_s + token_s * b`` the non-negative line
   through the differences of the steady inter-token gaps (each round's median gap while all
   ``b`` requests decode, measured against simulated);
5. prefill under load: ``probe_decoding`` requests stream ``probe_output`` tokens while
   ``probes`` prompts of ``probe_prompt`` tokens arrive ``probe_gap_s`` apart (2 tokens out
   each). The workers log their steps (``kvengine serve --step-trace``); ``prefill_factor``
   is the median, over the steps of that round that compute at least ``MIN_PREFILL_TOKENS``
   prompt tokens, of the worker's own forward-pass time over the engine curves' price for the
   same items: how much the stack's CPU slows prefill work, which 4. (decode steps) does not
   see. The probes' TTFTs against the simulator with the hop, step and token costs are kept
   beside it (``prefill_points``): what the split's path (the handoff, the second worker's
   first step) adds shows there, and is not a prefill slowdown.

It writes the profile back (``--out``; default in place) with the section
(``engine.profile.format.Serving``), plots measured, engine-only and engine + stack gaps
against the batch (``OUT.png``), and prints one JSON line. About two minutes on 2 CPUs for the
default model.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from benchmarks import lifecycle
from benchmarks.lifecycle import Configuration, Launched, kvrouter_up
from benchmarks.planner.step_fidelity import classify
from benchmarks.report import emit, pyplot, save_figure
from benchmarks.serving.compare import CONFIGS
from benchmarks.serving.load_client import ClientConfig, fetch_model, run_workload
from engine.profile.format import Profile, Serving, ServingPoint, ServingPrefillPoint, load, nonneg_lstsq, save
from kvstore.proc import free_port
from planner.metrics import RequestResult
from planner.sim.cluster import SimCluster
from planner.sim.config import ClusterConfig, from_up_flags
from planner.sim.costs import StepCosts
from planner.sim.run import Profiles
from planner.sim.worker import WorkerSpec
from planner.workloads import BenchRequest, TokenSpace

HOPS_PER_FIRST_TOKEN = 3
MIN_PREFILL_TOKENS = 32  # a step counts as prefill work from this many prompt tokens


def default_layout(profile: Profile) -> str:
    """``kvrouter up`` flags that fill the machine with workers of the profile's threads."""
    if profile.hardware.cpu_count // max(profile.hardware.threads, 1) >= 2:
        return CONFIGS["disagg"]["up"]
    return CONFIGS["colo_chunk"]["up"]


def requests(args: argparse.Namespace, vocab: int) -> list[list[BenchRequest]]:
    """The rounds, in order: the unloaded chain first, then ``rounds`` per batch size."""
    space = TokenSpace(vocab_size=vocab)
    rng = np.random.default_rng([args.seed, 11])
    chain = []
    for i in range(args.hops + 1):  # the first warms the path up and is not counted
        chain.append(BenchRequest(f"hop-{i}", space.random(rng, args.hop_prompt), 2,
                                  after=f"hop-{i - 1}" if i else None, delay_s=0.2 if i else 0.0))
    out = [chain]
    for b in args.batches:
        for r in range(args.rounds):
            out.append([BenchRequest(f"b{b}-r{r}-{j}", space.random(rng, args.prompt), args.output, tag=str(b))
                        for j in range(b)])
    out.append(probe_round(args, space, rng))
    return out


def probe_round(args: argparse.Namespace, space: TokenSpace, rng: np.random.Generator) -> list[BenchRequest]:
    """Step 5's round: streams first, then the probes (tag ``probe``) while they decode."""
    reqs = [BenchRequest(f"stream-{j}", space.random(rng, args.prompt), args.probe_output, tag="stream")
            for j in range(args.probe_decoding)]
    for i in range(args.probes):
        reqs.append(BenchRequest(f"probe-{i}", space.random(rng, args.probe_prompt), 2,
                                 arrival_s=args.probe_gap_s * (i + 1), tag="probe"))
    return reqs


def steady_gap(results: list[RequestResult]) -> float | None:
    """The median inter-token gap while every request of a round decodes: token times after
    the last first token and up to the first last token (times from the round's send)."""
    times = []
    for r in results:
        if not r.ok or r.ttft_s is None:
            return None
        t = [r.sent_s + r.ttft_s]
        for g in r.itl_s:
            t.append(t[-1] + g)
        times.append(t)
    lo = max(t[0] for t in times)
    hi = min(t[-1] for t in times)
    gaps = [b - a for t in times for a, b in zip(t, t[1:]) if a >= lo and b <= hi]
    return statistics.median(gaps) if gaps else None


def fit_line(batches: list[int], extra: list[float]) -> tuple[float, float]:
    """Non-negative ``(step_s, token_s)`` of ``extra ~ step_s + token_s * batch`` (least
    squares over the subsets whose coefficients come out non-negative; 0, 0 if none)."""
    y = np.array(extra, dtype=np.float64)
    coef = nonneg_lstsq(np.array([[1.0, float(b)] for b in batches]), y, np.ones_like(y))
    return (0.0, 0.0) if coef is None else (float(coef[0]), float(coef[1]))


def simulate(config: ClusterConfig, profile: Profile, rounds: list[list[BenchRequest]]) -> list[list[RequestResult]]:
    """The rounds through the simulator with the profile as given (``engine_only()``: the
    engine's curves and no serving cost)."""
    profiles = Profiles([profile])
    cluster = SimCluster(replace(config, hop_s=None), profiles.costs_for)
    out = []
    for reqs in rounds:
        run = cluster.run_workload(reqs)
        out.append(sorted(run.results, key=lambda r: r.request_id))
    return out


async def _measure(url: str, rounds: list[list[BenchRequest]], progress: bool,
                   windows: list[tuple[float, float]]) -> list[list[RequestResult]]:
    """The rounds through the real stack; ``windows`` gets each round's wall-clock span."""
    model = await fetch_model(url)
    cfg = ClientConfig(url, model, progress=False, request_timeout_s=300, max_duration_s=600, grace_s=120)
    out = []
    for reqs in tqdm(rounds, desc="stack profile", unit="round", disable=not progress):
        start = time.time()
        run = await run_workload(reqs, cfg, desc="round")
        windows.append((start, time.time()))
        bad = [r for r in run.results if not r.ok]
        if bad or len(run.results) != len(reqs):
            raise RuntimeError(f"a profiling request failed: {bad[0].error if bad else 'not sent'}")
        out.append(sorted(run.results, key=lambda r: r.request_id))
        await asyncio.sleep(0.5)
    return out


def serving_section(args: argparse.Namespace, layout: str, measured: list[list[RequestResult]],
                    simulated: list[list[RequestResult]]) -> Serving:
    chain_m, chain_s = measured[0][1:], simulated[0][1:]   # the first of the chain warms up
    by_id = {r.request_id: r for r in chain_s}
    diffs = [m.ttft_s - by_id[m.request_id].ttft_s for m in chain_m  # type: ignore[operator]
             if m.ttft_s is not None and by_id[m.request_id].ttft_s is not None]
    ttft_m = statistics.median(r.ttft_s for r in chain_m if r.ttft_s is not None)
    ttft_s = statistics.median(r.ttft_s for r in chain_s if r.ttft_s is not None)
    hop = max(statistics.median(diffs), 0.0) / HOPS_PER_FIRST_TOKEN
    points, batches, extra = [], [], []
    for m, s in zip(measured[1:], simulated[1:]):
        gm, gs = steady_gap(m), steady_gap(s)
        if gm is None or gs is None:
            continue
        b = len(m)
        points.append(ServingPoint(b, args.prompt, args.output, gm, gs))
        batches.append(b)
        extra.append(gm - gs)
    if not points:
        raise RuntimeError("no round had a steady window (every request decoding at once): raise --output")
    step_s, token_s = fit_line(batches, extra)
    how = (f"kvrouter up {layout} (model {args.model}); benchmarks.serving.load_client on the same machine; "
           f"{args.hops} unloaded {args.hop_prompt}-token requests, then {args.rounds} rounds of "
           f"{','.join(map(str, args.batches))} concurrent {args.prompt}+{args.output}-token requests; "
           f"seed {args.seed}")
    how += (f"; prefill under load: {args.probes} {args.probe_prompt}-token prompts {args.probe_gap_s} s apart "
            f"while {args.probe_decoding} requests stream {args.probe_output} tokens")
    return Serving(how=how, prompt_tokens=args.hop_prompt, hop_s=hop, step_s=step_s, token_s=token_s,
                   ttft_measured_s=ttft_m, ttft_simulated_s=ttft_s, points=tuple(points),
                   created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))


def prefill_spec(config: ClusterConfig) -> WorkerSpec:
    """The settings of the workers that prefill in ``config``."""
    return config.colocated_spec if config.mode == "colocated" else config.prefill_spec


def prefill_steps(costs: StepCosts, steps: list[dict[str, Any]], window: tuple[float, float]) -> list[float]:
    """Step 5's ratios: each traced step inside ``window`` that computes at least
    ``MIN_PREFILL_TOKENS`` prompt tokens, its forward pass over the curves' price."""
    out = []
    for x in steps:
        if not window[0] <= x["t"] <= window[1]:
            continue
        _, decodes, chunks = classify(x["items"])
        if sum(k for k, _ in chunks) < MIN_PREFILL_TOKENS:
            continue
        price = costs.step_s(decodes, chunks)
        if price > 0:
            out.append(x["execute_s"] / price)
    return out


def prefill_load(section: Serving, config: ClusterConfig, costs: StepCosts, probes: list[BenchRequest],
                 measured: list[RequestResult], simulated: list[RequestResult], ratios: list[float]) -> Serving:
    """Step 5: ``section`` with ``prefill_factor`` (the median of ``ratios``, from
    ``prefill_steps``) and the probes' TTFTs (``simulated``: the probe round through the
    simulator with ``section``'s hop, step and token costs)."""
    if not ratios:
        raise RuntimeError("no traced prefill step in the prefill-under-load round (are the workers tracing steps?)")
    spec = prefill_spec(config)
    chunk = spec.max_num_batched_tokens if spec.enable_chunked_prefill else 0
    sim = {r.request_id: r for r in simulated}
    streams = sum(1 for r in probes if r.tag == "stream")
    points = []
    for m in measured:
        s = sim.get(m.request_id)
        if not m.request_id.startswith("probe-") or s is None or m.ttft_s is None or s.ttft_s is None:
            continue
        n = next(len(r.prompt) for r in probes if r.request_id == m.request_id)
        points.append(ServingPrefillPoint(n, streams, m.ttft_s, s.ttft_s, costs.prefill_s(n, 0, chunk)))
    return replace(section, prefill_factor=statistics.median(ratios), prefill_steps=len(ratios),
                   prefill_points=tuple(points))


def plot(profile: Profile, path: Path) -> None:
    plt = pyplot()

    sv = profile.serving
    assert sv is not None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    bs = [p.batch for p in sv.points]
    ax.plot(bs, [p.measured_gap_s * 1e3 for p in sv.points], "o", label="through the stack (measured)")
    ax.plot(bs, [p.simulated_gap_s * 1e3 for p in sv.points], "x", label="engine curves alone (simulated)")
    grid = sorted(set(bs))
    base = {b: statistics.median(p.simulated_gap_s for p in sv.points if p.batch == b) for b in grid}
    ax.plot(grid, [(base[b] + sv.step_s + sv.token_s * b) * 1e3 for b in grid], "-",
            label=f"engine + stack: +{sv.step_s * 1e3:.1f} ms/step +{sv.token_s * 1e3:.2f} ms/token")
    ax.set_xlabel("sequences decoding at once")
    ax.set_ylabel("inter-token gap (ms)")
    ax.set_title(f"What the serving stack adds ({profile.hardware.threads} thread(s) a worker); "
                 f"hop {sv.hop_s * 1e3:.1f} ms", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    profile = load(args.profile)
    layout = args.up or default_layout(profile)
    config = from_up_flags("stack", f"{layout} --store-memory 2G")
    rounds = requests(args, profile.model.vocab_size)
    out = Path(args.out or args.profile)
    logs = out.parent / (out.stem + "_stack_logs")
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    for old in logs.glob("steps-*.jsonl"):
        old.unlink()
    command = kvrouter_up(args.model, port, logs, "2G", layout, step_trace_dir=logs)
    t0 = time.perf_counter()
    launched = Launched(Configuration("stack", command=command), open(logs / "up.log", "w"))
    try:
        launched.wait_ready(300)
        windows: list[tuple[float, float]] = []
        measured = asyncio.run(_measure(f"http://127.0.0.1:{port}", rounds, not args.no_progress, windows))
    finally:
        launched.stop()
    simulated = simulate(config, profile.engine_only(), rounds)
    section = serving_section(args, layout, measured[:-1], simulated[:-1])
    probes = rounds[-1]
    with_stack = simulate(config, replace(profile, serving=section), [probes])[0]
    costs = Profiles([profile.engine_only()]).costs_for(prefill_spec(config))
    steps = [json.loads(x) for f in sorted(logs.glob("steps-*.jsonl")) for x in f.read_text().splitlines() if x.strip()]
    ratios = prefill_steps(costs, steps, windows[-1])
    section = prefill_load(section, config, costs, probes, measured[-1], with_stack, ratios)
    profile = replace(profile, serving=section)
    save(profile, out)
    plot(profile, out.with_suffix(".png"))
    return {"bench": "stack_profile", "profile": str(out), "threads": profile.hardware.threads,
            "hop_ms": round(section.hop_s * 1e3, 2), "step_ms": round(section.step_s * 1e3, 3),
            "token_ms": round(section.token_s * 1e3, 3),
            "gaps_ms": [[p.batch, round(p.measured_gap_s * 1e3, 1), round(p.simulated_gap_s * 1e3, 1)]
                        for p in section.points],
            "ttft_ms": [round(section.ttft_measured_s * 1e3, 1), round(section.ttft_simulated_s * 1e3, 1)],
            "prefill_factor": round(section.prefill_factor, 3), "prefill_steps": section.prefill_steps,
            "probe_ttft_ms": [[round(p.measured_ttft_s * 1e3, 1), round(p.simulated_ttft_s * 1e3, 1),
                               round(p.engine_prefill_s * 1e3, 1)] for p in section.prefill_points],
            "seconds": round(time.perf_counter() - t0, 1)}


def batch_sizes(text: str) -> list[int]:
    """An argparse type: comma-separated positive batch sizes."""
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes are positive integers, got {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner.stack_profile",
                                description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, help="the kvengine profile file to add the serving section to")
    p.add_argument("--out", default=None, help="where to write the profile (default: over --profile)")
    p.add_argument("--model", default="default", help="the model kvrouter up serves (the profile's)")
    p.add_argument("--up", default=None,
                   help="kvrouter up layout flags (default: benchmarks.serving.compare's layout for the "
                        "profile's threads)")
    p.add_argument("--hops", type=int, default=6, help="unloaded requests for the hop (after one warm-up)")
    p.add_argument("--hop-prompt", type=int, default=32, help="their prompt tokens")
    p.add_argument("--batches", type=batch_sizes, default=[1, 2, 4, 8], help="concurrent requests per round")
    p.add_argument("--rounds", type=int, default=2, help="rounds per batch size")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens of a round's requests")
    p.add_argument("--output", type=int, default=96, help="output tokens of a round's requests")
    p.add_argument("--probes", type=int, default=4, help="prompts sent while others stream (prefill under load)")
    p.add_argument("--probe-prompt", type=int, default=384, help="their prompt tokens")
    p.add_argument("--probe-gap-s", type=float, default=2.0, help="seconds between them")
    p.add_argument("--probe-decoding", type=int, default=2, help="requests streaming while they arrive")
    p.add_argument("--probe-output", type=int, default=288,
                   help="those requests' output tokens (enough to outlast the probes)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.hops < 1 or args.rounds < 1 or args.output < 3:
        raise SystemExit("--hops and --rounds are at least 1, --output at least 3")
    if args.probes < 1 or args.probe_prompt < 1 or args.probe_decoding < 1 or args.probe_gap_s <= 0:
        raise SystemExit("--probes, --probe-prompt and --probe-decoding are at least 1, --probe-gap-s positive")
    emit(run(args))


if __name__ == "__main__":
    sys.exit(lifecycle.run_main(main))
