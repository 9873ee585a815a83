"""The workloads' command-line flags, shared by the load generator and ``kvplan``.

``add_workload_args(parser)`` adds ``--workload``, ``--num-requests``, ``--seed`` and one
``--{prefix}-{field}`` flag per field of each workload spec (``planner.workloads``: the token
space's unprefixed, ``--mixed-*``, ``--chat-*``, ``--trace-*``), each with its default and help
from the spec's dataclass; ``build_workload(args, rate, seed)`` builds the workload they
describe. ``benchmarks.serving.serve_bench`` / ``benchmarks.serving.sweep`` and ``kvplan simulate`` take the same
flags and build the same requests from them, so a simulated point is the measured point's twin.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from planner.workloads import ChatSpec, MixedSpec, TokenSpace, TraceSpec, Workload

__all__ = ["WORKLOADS", "add_spec_args", "spec_from_args", "add_workload_args", "build_workload"]

WORKLOADS = {"mixed": ("mixed", MixedSpec), "multi_turn": ("chat", ChatSpec), "trace": ("trace", TraceSpec)}

def add_spec_args(parser: argparse.ArgumentParser, cls: type, prefix: str) -> None:
    """One ``--{prefix}-{field}`` flag per field of a spec dataclass, default and help from it."""
    group = parser.add_argument_group(f"{prefix or 'token space'} options")
    for f in dataclasses.fields(cls):
        flag = "--" + "-".join(x for x in (prefix, f.name.replace("_", "-")) if x)
        dest, metavar = (f"{prefix}_{f.name}" if prefix else f.name), f.name.upper()
        if f.type in (bool, "bool"):
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                               default=f.default, help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            group.add_argument(flag, dest=dest, metavar=metavar, type=kind, default=f.default,
                               help=f"{f.metadata['help']} (default {f.default})")


def spec_from_args(args: argparse.Namespace, cls: type, prefix: str) -> Any:
    return cls(**{f.name: getattr(args, f"{prefix}_{f.name}" if prefix else f.name) for f in dataclasses.fields(cls)})


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """``--workload``, ``--num-requests``, ``--seed`` and every spec's flags (module docstring)."""
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mixed",
                        help="mixed: short decode-heavy requests and rare huge prefills; multi_turn: chat sessions "
                             "sharing their history; trace: a window of the Mooncake "
                             "trace (default mixed)")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="mixed: requests (default 200); others: at most this many open-loop requests")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and its arrivals")
    add_spec_args(parser, TokenSpace, "")
    for prefix, cls in WORKLOADS.values():
        add_spec_args(parser, cls, prefix)


def build_workload(args: argparse.Namespace, rate: float | None, seed: int) -> Workload:
    """The workload the flags describe at ``rate`` (``None``: the trace's own timing)."""
    space = spec_from_args(args, TokenSpace, "")
    prefix, cls = WORKLOADS[args.workload]
    spec = spec_from_args(args, cls, prefix)
    if args.workload == "mixed":
        wl = spec.build(args.num_requests or 200, rate or 1.0, seed, space)
    elif args.workload == "multi_turn":
        wl = spec.build(rate or 1.0, seed, space)
    else:
        wl = spec.build(rate, seed, space)
    if args.num_requests and args.workload != "mixed":
        wl = wl.truncate(args.num_requests)
    wl.scaling.update(space=dataclasses.asdict(space), rate=rate, seed=seed)
    return wl
