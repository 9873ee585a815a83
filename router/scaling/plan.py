"""From desired counts to actions inside a budget: what ``kvrouter up --autoscale`` does.

A :class:`Layout` is ``prefill`` prefill workers and ``decode`` decode workers; ``prefill ==
0`` is the colocated state (in the router's ``auto`` mode a decode worker with no prefill pool
prefills its own requests). :func:`fit_budget` turns the router's desired counts into the
layout to aim for within ``max_workers``:

- each pool asks for its desired count (decode at least 1, prefill at least ``min_prefill``);
- over the budget, a split asked from the colocated state (prefill 0 -> 1) goes first: it is
  the remedy for prefill work stalling the decodes, which otherwise reads as "more decode";
  but not while the decode pressure is the higher one: both pools short and the decodes more
  so is a cluster over its capacity for decodes (requests wait for KV room, and a waiting
  request reads as queued prefill), which a split makes worse by taking a decode worker (it
  stays colocated; measured in ``benchmarks/planner/autoscale_bench.py``: a split at 19 s into its
  decode-heavy half cost the autoscaled cluster 0.64x the best static layout). In the
  colocated state the prefill pressure reaches the decode pressure exactly when prefill's
  share of the workers' time explains the decodes' stalls (``policy.pressures``), so a tie
  splits. Then each pool keeps what it has and still wants, and what is left goes to the
  pool under the higher pressure.

:func:`actions` turns the current workers into the target, cheapest first: **role changes**
(a worker of the pool that shrinks becomes one of the pool that grows: no process starts,
and it is drained first), then **starts** (a pool still short) or **stops** (a pool still
over). Workers to change or stop are the least loaded first (the quickest drains).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from engine.api.generate import WorkerRole
from router.scaling.signals import POOLS, Pool

__all__ = ["Layout", "WorkerState", "Action", "fit_budget", "actions", "role_of_pool"]


@dataclass(frozen=True, order=True)
class Layout:
    prefill: int
    decode: int

    @property
    def total(self) -> int:
        return self.prefill + self.decode

    @property
    def colocated(self) -> bool:
        return self.prefill == 0

    def count(self, pool: Pool) -> int:
        return self.prefill if pool == "prefill" else self.decode

    def __str__(self) -> str:
        return f"colocated x{self.decode}" if self.colocated else f"{self.prefill}P+{self.decode}D"


def role_of_pool(pool: Pool) -> WorkerRole:
    """The role a worker of ``pool`` is given (decode workers also prefill in the colocated
    state, the router's ``auto`` mode sending them every request whole)."""
    return "prefill" if pool == "prefill" else "decode"


@dataclass(frozen=True)
class WorkerState:
    """A worker as the launcher sees it: its name (the child's), pool, and load (requests
    queued and running, from the router's books)."""

    name: str
    pool: Pool
    load: int = 0


@dataclass(frozen=True)
class Action:
    """``role``: ``worker`` changes to ``to``'s role; ``start``: a worker of ``to``'s role
    starts (``worker`` None); ``stop``: ``worker`` stops."""

    kind: Literal["role", "start", "stop"]
    to: Pool
    worker: str | None = None

    def __str__(self) -> str:
        if self.kind == "role":
            return f"role change {self.worker} -> {role_of_pool(self.to)}"
        if self.kind == "start":
            return f"start a {role_of_pool(self.to)} worker"
        return f"stop {self.worker} ({self.to})"


def fit_budget(current: Layout, desired: Mapping[Pool, int], pressure: Mapping[Pool, float],
               max_workers: int, min_prefill: int = 0) -> Layout:
    """The layout to aim for (module docstring)."""
    if max_workers < 1 + min_prefill:
        raise ValueError(f"max_workers {max_workers} cannot hold one decode worker and "
                         f"{min_prefill} prefill worker(s)")
    want: dict[Pool, int] = {"prefill": max(min_prefill, desired["prefill"]),
                             "decode": max(1, desired["decode"])}
    if want["prefill"] + want["decode"] <= max_workers:
        return Layout(want["prefill"], want["decode"])
    if current.prefill == 0 and want["prefill"] > 0:   # the split first
        if pressure.get("decode", 0.0) > pressure.get("prefill", 0.0):
            return current     # both short, the decodes more: a split takes a decode worker
        p = min(want["prefill"], max_workers - 1)
        return Layout(p, max_workers - p)
    keep: dict[Pool, int] = {pool: min(want[pool], current.count(pool)) for pool in POOLS}
    keep["decode"] = max(keep["decode"], 1)
    keep["prefill"] = max(keep["prefill"], min_prefill)
    left = max_workers - keep["prefill"] - keep["decode"]
    for pool in sorted(POOLS, key=lambda q: -pressure.get(q, 0.0)):   # the higher pressure first
        extra = min(left, want[pool] - keep[pool])
        keep[pool] += max(0, extra)
        left -= max(0, extra)
    return Layout(keep["prefill"], keep["decode"])


def actions(workers: Sequence[WorkerState], target: Layout) -> list[Action]:
    """The steps from ``workers`` to ``target`` (module docstring), in order."""
    by_pool: dict[Pool, list[WorkerState]] = {
        pool: sorted((w for w in workers if w.pool == pool), key=lambda w: (w.load, w.name))
        for pool in POOLS}
    out: list[Action] = []
    pairs: tuple[tuple[Pool, Pool], ...] = (("prefill", "decode"), ("decode", "prefill"))
    for grow, shrink in pairs:
        short = target.count(grow) - len(by_pool[grow])
        spare = len(by_pool[shrink]) - target.count(shrink)
        for w in by_pool[shrink][:max(0, min(short, spare))]:
            out.append(Action("role", grow, w.name))
            by_pool[shrink].remove(w)
            by_pool[grow].append(w)
    for pool in POOLS:   # stops before starts: the budget holds at every step
        out += [Action("stop", pool, w.name)
                for w in by_pool[pool][:max(0, len(by_pool[pool]) - target.count(pool))]]
    for pool in POOLS:
        out += [Action("start", pool) for _ in range(target.count(pool) - len(by_pool[pool]))]
    return out
