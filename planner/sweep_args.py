"""The flags ``kvplan simulate`` and ``kvplan recommend`` share, and the sweep settings they give.

``add_objective_args(parser)`` adds ``--profile``, the sweep's ``--rates``, ``--point-seconds``,
``--slo-ref`` and ``--prewarm-concurrency`` (``kvplan simulate``), the objectives' flags (fixed
``--ttft-slo-ms``/``--tpot-slo-ms``, or multiples of the unloaded latencies), ``--out`` and the
workload's flags (``planner.workload_args``);
``settings_from_args(args)`` is the ``planner.sim.sweep.SweepSettings`` they describe.
"""

from __future__ import annotations

import argparse

from planner.metrics import Slo
from planner.sim.sweep import SweepSettings
from planner.workload_args import add_workload_args

__all__ = ["add_objective_args", "settings_from_args"]


def add_objective_args(p: argparse.ArgumentParser, sweep: bool = True) -> None:
    """``sweep``: also the flags of a sweep over listed rates (``kvplan simulate``; ``kvplan
    recommend`` searches the rate itself)."""
    p.add_argument("--profile", action="append", required=True, metavar="PATH",
                   help="a `kvengine profile` file; repeat for profiles at other thread counts "
                        "(each worker uses the one measured with its --threads-per-worker)")
    if sweep:
        p.add_argument("--rates", default="0.1,0.2,0.3,0.4,0.5",
                       help="comma-separated requests/s (default %(default)s)")
        p.add_argument("--point-seconds", type=float, default=60.0,
                       help="each point's length: sends for 3/4 of it, cancels what is left at its end (default 60)")
    p.add_argument("--unloaded-samples", type=int, default=3,
                   help="unloaded probes whose medians set the objectives (default 3)")
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="fixed TTFT objective (ms)")
    p.add_argument("--tpot-slo-ms", type=float, default=None, help="fixed TPOT objective (ms)")
    p.add_argument("--ttft-slo-per-token-ms", type=float, default=0.0,
                   help="with --ttft-slo-ms: its growth per prompt token past --ttft-slo-ref-tokens")
    p.add_argument("--ttft-slo-ref-tokens", type=int, default=0,
                   help="prompt length at which the TTFT objective is --ttft-slo-ms (default 0)")
    p.add_argument("--ttft-slo-per-length", action="store_true",
                   help="unloaded objectives per prompt length (a second probe at the 90th-percentile prompt)")
    p.add_argument("--ttft-slo-mult", type=float, default=5.0, help="TTFT objective / unloaded TTFT (default 5)")
    p.add_argument("--tpot-slo-mult", type=float, default=2.0, help="TPOT objective / unloaded TPOT (default 2)")
    if sweep:
        p.add_argument("--slo-ref", choices=["first", "own"], default="first",
                       help="objectives from the first configuration's probes (default) or each one's own")
    p.add_argument("--salt-per-request", action="store_true",
                   help="every request a cache salt of its own: no prefix reuse between requests")
    if sweep:
        p.add_argument("--prewarm-concurrency", type=int, default=4,
                       help="requests in flight while the pre-warm set is sent (default 4)")
    p.add_argument("--out", default=None, help="directory for the JSON record and the plots")
    add_workload_args(p)


def settings_from_args(args: argparse.Namespace) -> SweepSettings:
    fixed = None
    if args.ttft_slo_ms and args.tpot_slo_ms:
        fixed = Slo(args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3, args.ttft_slo_per_token_ms / 1e3,
                    args.ttft_slo_ref_tokens)
    rates = tuple(float(r) for r in args.rates.split(","))
    if not rates or min(rates) <= 0:
        raise ValueError(f"--rates must be positive, got {args.rates!r}")
    return SweepSettings(rates, args.point_seconds, args.unloaded_samples, args.ttft_slo_mult,
                         args.tpot_slo_mult, args.ttft_slo_per_length, args.slo_ref, fixed,
                         args.prewarm_concurrency)
