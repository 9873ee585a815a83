"""How steady this machine is: the same decode step, timed over and over.

    python -m benchmarks.planner.steadiness [--threads 1 --cpus 1] [--blocks 20 --block-seconds 2]

A simulator calibrated from a profile is only as right as the machine is steady between the
profile and the run it predicts. This measures that floor directly, with nothing else in the
way: one process, the engine's own ``ModelRunner.execute`` on a paged cache of seeded values,
one decode step of each batch in ``--batches`` at ``--context`` tokens, back to back, in
``--blocks`` blocks of ``--block-seconds`` each. Blocks alternate between pinned to
``--cpus`` (as ``kvrouter up --*-cpus`` pins a worker) and free to run on any CPU, so the
pinned/free ratio is measured at the same moments and drift cancels out of it.

It prints one JSON line:
- per batch, the median step time pinned and free, and their ratio;
- ``spread``: the slowest block's median over the fastest's, per batch and mode. That is how far
  this machine's speed moved within the run.

Run it a few times a few minutes apart, and compare the medians across runs: that is how far
it moves between a profile and a run. About 45 s for the default blocks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from benchmarks import lifecycle
from benchmarks.planner.stack_profile import batch_sizes
from benchmarks.report import emit
from router.cluster.child import parse_cpus


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from tqdm import tqdm

    from engine.api.paths import resolve_model_dir
    from engine.model.runner import ModelRunner, StepItem

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    bs = 16
    per_seq = -(-(args.context + 1) // bs)
    runner = ModelRunner(resolve_model_dir(args.model), num_blocks=max(args.batches) * per_seq,
                         block_size=bs, device="cpu")
    runner.kv_cache.normal_(generator=torch.Generator().manual_seed(args.seed))
    steps = {b: [StepItem([100 + i], args.context, list(range(i * per_seq, (i + 1) * per_seq)))
                 for i in range(b)] for b in args.batches}
    for items in steps.values():  # warm-up
        runner.execute(items)
    everywhere = set(range(os.cpu_count() or 1))
    blocks: list[dict[str, Any]] = []
    try:
        for k in tqdm(range(args.blocks), desc="steadiness", unit="block", disable=args.no_progress):
            mode = "pinned" if k % 2 else "free"
            os.sched_setaffinity(0, args.cpus if mode == "pinned" else everywhere)
            seen: dict[int, list[float]] = {b: [] for b in steps}
            end = time.perf_counter() + args.block_seconds
            while time.perf_counter() < end:
                for b, items in steps.items():
                    t0 = time.perf_counter()
                    runner.execute(items)
                    seen[b].append(time.perf_counter() - t0)
            blocks.append({"mode": mode, "median_ms": {b: statistics.median(v) * 1e3 for b, v in seen.items()}})
    finally:
        os.sched_setaffinity(0, everywhere)
    return summarize(blocks, args)


def summarize(blocks: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON line (module docstring) from each block's per-batch medians."""
    out: dict[str, Any] = {"bench": "steadiness", "model": args.model, "threads": args.threads,
                           "cpus": sorted(args.cpus), "context": args.context, "blocks": len(blocks),
                           "block_seconds": args.block_seconds, "batches": {}}
    for b in args.batches:
        row: dict[str, Any] = {}
        for mode in ("pinned", "free"):
            meds = [x["median_ms"][b] for x in blocks if x["mode"] == mode]
            if meds:
                row[f"{mode}_ms"] = round(statistics.median(meds), 2)
                row[f"{mode}_spread"] = round(max(meds) / min(meds), 3)
        if "pinned_ms" in row and "free_ms" in row:
            row["pinned_over_free"] = round(row["pinned_ms"] / row["free_ms"], 3)
        out["batches"][str(b)] = row
    out["per_block_ms"] = [[x["mode"], {str(b): round(v, 2) for b, v in x["median_ms"].items()}] for x in blocks]
    return out


def _cpus(text: str) -> frozenset[int]:
    """``kvrouter up``'s CPU-list syntax (``router.cluster.child.parse_cpus``), this machine's CPUs only."""
    try:
        out = parse_cpus(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not out <= set(range(os.cpu_count() or 1)):
        raise argparse.ArgumentTypeError(f"--cpus names CPUs this machine does not have: {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner.steadiness",
                                description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="checkpoint directory, or 'default' (SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the split's workers)")
    p.add_argument("--cpus", type=_cpus, default=None,
                   help="CPUs of the pinned blocks, as kvrouter up takes them: 1, 0,1 or 0-1 "
                        "(default: the last --threads CPUs)")
    p.add_argument("--batches", type=batch_sizes, default=[1, 8], help="decode batch sizes (default 1,8)")
    p.add_argument("--context", type=int, default=128, help="tokens already in each sequence's cache")
    p.add_argument("--blocks", type=int, default=20, help="timed blocks, alternating free and pinned")
    p.add_argument("--block-seconds", type=float, default=2.0, help="seconds a block")
    p.add_argument("--seed", type=int, default=0, help="seeds the cache's values")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads < 1 or args.blocks < 2 or args.block_seconds <= 0 or args.context < 1:
        raise SystemExit("--threads >= 1, --blocks >= 2 (one of each mode), --block-seconds > 0, --context >= 1")
    n = os.cpu_count() or 1
    args.cpus = args.cpus or frozenset(range(max(n - args.threads, 0), n))
    emit(measure(args))


if __name__ == "__main__":
    sys.exit(lifecycle.run_main(main))
