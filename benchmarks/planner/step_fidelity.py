"""The simulator's step times against the steps a worker really ran under load.

    python -m benchmarks.serving.compare --step-trace --out results/st ...      # workers log their steps
    python -m benchmarks.planner.step_fidelity --profile profile_t2.json results/st/colo_nochunk/steps-*.jsonl

Each line of a step trace (``kvengine serve --step-trace``) is one engine step: its wall time
(``step_s``: scheduling, the model, sampling, streaming), the model's share (``execute_s``)
and its items (``[tokens, start]``; a decode is ``[1, context]``). For every step this prices
the same items with ``planner.sim.costs.StepCosts`` (the profile's engine curves alone: its
serving section prices the router and client, which a worker's own step does not hold) and reports, per kind
of step (decode-only by batch size, prefill-only, mixed), the median ratio of measured to
predicted, for the model's share and for the whole step, and how many steps each covers.
A ratio above 1 is time the simulator does not see: contention for the CPUs (the router,
the load generator, the store on the same cores), or per-step work beyond the forward pass.
Prints one JSON line; ``--out`` writes it to a file too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.report import emit
from engine.profile.format import load as load_profile
from planner.sim.costs import StepCosts

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 1 << 30)


def _bucket(n: int) -> str:
    lo = 1
    for hi in BATCH_BUCKETS:
        if n <= hi:
            return f"decode {lo}" if lo == hi else f"decode {lo}-{hi}" if hi < 1 << 30 else f"decode {lo}+"
        lo = hi + 1
    raise AssertionError


def classify(items: list[list[int]]) -> tuple[str, list[int], list[tuple[int, int]]]:
    """(kind, decode contexts, prefill chunks) of one step's items."""
    decodes = [start for n, start in items if n == 1 and start > 0]
    chunks = [(n, start) for n, start in items if not (n == 1 and start > 0)]
    if chunks and decodes:
        return "mixed", decodes, chunks
    if chunks:
        return "prefill", decodes, chunks
    return _bucket(len(decodes)), decodes, chunks


def compare(costs: StepCosts, lines: list[dict[str, Any]]) -> dict[str, Any]:
    exe: dict[str, list[float]] = defaultdict(list)
    whole: dict[str, list[float]] = defaultdict(list)
    busy = sum(x["step_s"] for x in lines)
    for x in lines:
        kind, decodes, chunks = classify(x["items"])
        pred = costs.step_s(decodes, chunks)
        if pred <= 0:
            continue
        exe[kind].append(x["execute_s"] / pred)
        whole[kind].append(x["step_s"] / pred)
        exe["all"].append(x["execute_s"] / pred)
        whole["all"].append(x["step_s"] / pred)
    span = (lines[-1]["t"] - lines[0]["t"]) if len(lines) > 1 else 0.0
    return {
        "steps": len(lines), "busy_s": round(busy, 3), "span_s": round(span, 3),
        "kinds": {k: {"steps": len(v), "execute_over_sim_p50": round(statistics.median(v), 3),
                      "step_over_sim_p50": round(statistics.median(whole[k]), 3)}
                  for k, v in sorted(exe.items())},
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner.step_fidelity",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("traces", nargs="+", help="step trace files (kvengine serve --step-trace)")
    p.add_argument("--profile", required=True, help="the profile to price the steps with")
    p.add_argument("--block-size", type=int, default=None, help="the workers' block size (default the profile's)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    costs = StepCosts(load_profile(args.profile).engine_only(), args.block_size)
    out: dict[str, Any] = {"bench": "step_fidelity", "profile": args.profile, "traces": {}}
    for path in args.traces:
        lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
        out["traces"][path] = compare(costs, lines) if lines else {"steps": 0}
    emit(out, args.out or None)


if __name__ == "__main__":
    sys.exit(main())
