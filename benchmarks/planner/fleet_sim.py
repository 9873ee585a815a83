"""Simulated GPU fleets on the full Mooncake trace: what ``kvplan recommend`` says for 8 to 64
GPUs, and colocated against the recommended split, DistServe-style. **A simulation**: no GPU
ran; step times come from a GPU profile built from published measurements
(``planner/profiles``), named in every record.

    python -m benchmarks.planner.fleet_sim --sizes 8,16,32,64 --out results/fleet_sim

For each fleet of N GPUs (one worker a GPU, each with its own KV blocks; the store holds
``--store-gib-per-gpu`` x N of host memory, least recently used out):

1. ``recommend``: the colocated fleet and the prefill:decode splits at ``--prefill-shares`` of
   N, chunked prefill at ``--chunk`` tokens, on the trace window at ``--rates-per-gpu`` x N
   req/s; the best by goodput per GPU (the highest rate keeping ``--attainment``).
2. Colocated against the recommended split: goodput against rate (the same rates) and
   attainment against SLO scale (DistServe's second curve) at the middle rate.

Objectives (``objectives``): TTFT <= ``--ttft-slo-mult`` x the unloaded TTFT at the request's
own prompt length, TPOT <= ``--tpot-slo-ms``; one pair for every configuration of a size.
Writes ``OUT/fleet_sim.json`` and ``OUT/fleet_goodput.png`` (goodput per GPU against rate per
GPU, and attainment against SLO scale, one panel per size), and prints one JSON line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lifecycle import REPO
from benchmarks.report import emit, pyplot, save_figure, write_json
from planner.metrics import SLO_SCALES, Slo
from planner.recommend import candidates, recommend
from planner.sim.run import Profiles, unloaded
from planner.sim.sweep import SweepSettings
from planner.workload_args import add_workload_args, spec_from_args
from planner.workloads import TokenSpace

DEFAULT_PROFILE = REPO / "planner" / "profiles" / "a100_vidur_llama3_8b.json"


def _args(ns: argparse.Namespace) -> argparse.Namespace:
    """The workload flags: the trace at native scale, its window, the model's context."""
    p = argparse.ArgumentParser()
    add_workload_args(p)
    return p.parse_args(["--workload", "trace", "--trace-scale", "1", "--trace-start", str(ns.trace_start),
                         "--trace-count", str(ns.trace_count), "--max-context", str(ns.max_context),
                         "--trace-prewarm", "none", "--seed", str(ns.seed)])


def objectives(config, profiles: Profiles, args: argparse.Namespace, ns: argparse.Namespace) -> Slo:
    """TTFT: ``--ttft-slo-mult`` x the unloaded TTFT at the request's own length (a line through
    probes at the window's median and 90th-percentile prompts, on one GPU of the colocated
    fleet); TPOT: ``--tpot-slo-ms``, fixed (a decode step's time grows with its context, so a
    multiple of a median-context probe would fail every long conversation by construction)."""
    from planner.workload_args import build_workload

    wl = build_workload(args, None, args.seed * 1000)
    space = spec_from_args(args, TokenSpace, "")
    u = unloaded(config, profiles, space, wl.probe_shape(), 1, args.seed, wl.long_probe_prompt())
    ttft = u.slo(ns.ttft_slo_mult, 1.0)
    return Slo(ttft.ttft_s, ns.tpot_slo_ms / 1e3, ttft.ttft_per_token_s, ttft.ref_prompt_tokens)


def run_size(n: int, profiles: Profiles, ns: argparse.Namespace, say: Any) -> dict[str, Any]:
    args = _args(ns)
    rates = tuple(round(r * n, 4) for r in ns.rates_per_gpu)
    cands_probe = candidates(n, 1, [ns.chunk], ns.num_blocks, ns.max_context, 1 << 40, max_workers=n,
                             prefill_shares=[], per_worker_blocks=True, block_size=ns.block_size)
    slo = objectives(cands_probe[-1], profiles, args, ns)
    shares = [float(x) for x in ns.prefill_shares.split(",")]
    cands = candidates(n, 1, [ns.chunk], ns.num_blocks, ns.max_context, n * ns.store_gib_per_gpu << 30, max_workers=n,
                       prefill_shares=shares, per_worker_blocks=True, max_num_seqs=ns.max_num_seqs,
                       block_size=ns.block_size)
    cands = [c for c in cands if c.mode != "colocated" or c.colocated == n]   # the fleet, not one GPU
    s = SweepSettings(rates, ns.point_seconds, 1, fixed_slo=slo)
    t0 = time.perf_counter()
    rec = recommend(cands, profiles, args, s, gpu=True, target=ns.attainment,
                    on_candidate=lambda row: say(f"{n} GPUs: {row['name']} {row['max_rate_90']:.3g} req/s "
                                                 f"({row['goodput_per_device']:.3g} per GPU)"))
    colo = next(r for r in rec["ranked"] if r["name"].startswith("colo"))
    split = next((r for r in rec["ranked"] if r["name"].startswith("split")), None)
    curves = {}
    for row in [colo] + ([split] if split else []):
        pts = row["curve"]
        mid = pts[len(pts) // 2]
        curves[row["name"]] = {"label": row["label"], "rates": [p["rate"] for p in pts],
                               "goodput": [p["goodput"] for p in pts], "attainment": [p["attainment"] for p in pts],
                               "ttft_p90": [p["ttft_p90"] for p in pts], "tpot_p90": [p["tpot_p90"] for p in pts],
                               "scale_rate": mid["rate"], "slo_scales": SLO_SCALES,
                               "attainment_at_scale": mid["attainment_at_scale"]}
    return {"gpus": n, "rates": list(rates), "recommendation": rec["verdict"], "best": rec["best"],
            "runner_up": rec["runner_up"], "ranked": rec["ranked"], "colocated": colo, "split": split,
            "curves": curves, "seconds": time.perf_counter() - t0}


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(2, len(results), figsize=(4.2 * len(results), 7.5), squeeze=False)
    for j, r in enumerate(results):
        n = r["gpus"]
        for name, c in r["curves"].items():
            style = "o-" if name.startswith("split") else "s--"
            axes[0][j].plot([x / n for x in c["rates"]], [g / n for g in c["goodput"]], style, label=c["label"])
            axes[1][j].plot(c["slo_scales"], c["attainment_at_scale"], style,
                            label=f"{c['label']} @ {c['scale_rate']:g}")
        axes[0][j].set_title(f"{n} GPUs: best {r['best']['label']}", fontsize=9)
        axes[0][j].set_xlabel("rate per GPU (req/s)")
        axes[0][j].set_ylabel("goodput per GPU (req/s)")
        axes[1][j].set_xlabel("SLO scale")
        axes[1][j].set_ylabel("attainment")
        axes[1][j].axhline(0.9, color="grey", lw=0.8)
        for ax in (axes[0][j], axes[1][j]):
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner.fleet_sim",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--profile", default=str(DEFAULT_PROFILE), help="a GPU profile (default: %(default)s)")
    p.add_argument("--sizes", default="8,16,32,64", help="fleet sizes in GPUs (default %(default)s)")
    p.add_argument("--rates-per-gpu", type=lambda s: [float(x) for x in s.split(",")], default=[0.1, 0.2, 0.3, 0.4],
                   help="request rates per GPU (default 0.1,0.2,0.3,0.4)")
    p.add_argument("--prefill-shares", default="0.25,0.5,0.75",
                   help="split shares of prefill GPUs (default %(default)s)")
    p.add_argument("--chunk", type=int, default=2048, help="chunked prefill's per-step tokens (default 2048)")
    p.add_argument("--block-size", type=int, default=64,
                   help="tokens per KV block (default 64: the simulation's cost is per block; 16 is 4x slower)")
    p.add_argument("--num-blocks", type=int, default=6500,
                   help="KV blocks per GPU (default 6500: 55 GB of an 80 GB A100 at 64 tokens x 128 KiB)")
    p.add_argument("--store-gib-per-gpu", type=int, default=128,
                   help="the store's host memory per GPU in GiB (default 128: a Mooncake-style DRAM pool)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="running requests per GPU (default 256)")
    p.add_argument("--max-context", type=int, default=131072, help="the model's context (default 131072)")
    p.add_argument("--trace-start", type=int, default=0, help="the trace window's first request (default 0)")
    p.add_argument("--trace-count", type=int, default=3993, help="requests in the window (default: all 3993)")
    p.add_argument("--point-seconds", type=float, default=1400.0,
                   help="each point's length (default 1400: the whole trace at its own rate and more)")
    p.add_argument("--ttft-slo-mult", type=float, default=5.0, help="TTFT objective / unloaded at its length")
    p.add_argument("--tpot-slo-ms", type=float, default=100.0,
                   help="TPOT objective in ms, fixed (default 100: 10 tokens/s a stream)")
    p.add_argument("--attainment", type=float, default=0.9, help="the attainment goodput counts at (default 0.9)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthesized tokens (default 0)")
    p.add_argument("--out", default="results/fleet_sim", help="output directory (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    profiles = Profiles.from_files([ns.profile])
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    say = lambda m: print(f"[fleet_sim] {m}", file=sys.stderr, flush=True)  # noqa: E731
    results = []
    for n in (int(x) for x in ns.sizes.split(",")):
        results.append(run_size(n, profiles, ns, say))
        say(f"{n} GPUs: {results[-1]['recommendation']}")
        rec = {"bench": "fleet_sim", "simulated": True, "profile": ns.profile, "profiles": profiles.describe(),
               "settings": {k: v for k, v in vars(ns).items()}, "sizes": results}
        write_json(out / "fleet_sim.json", rec)
    plot(results, out / "fleet_goodput.png",
         f"SIMULATED: Mooncake trace ({ns.trace_count} requests, native scale) on {profiles.describe()[0][:80]}")
    emit({"bench": "fleet_sim", "simulated": True, "profiles": profiles.describe(),
                      "sizes": [{k: r[k] for k in ("gpus", "recommendation", "seconds")} for r in results]})


if __name__ == "__main__":
    main()
