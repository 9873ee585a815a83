"""Per-pool scaling signals from the router's books: pure arithmetic over ``WorkerLoad`` s.

Pools (``POOLS``): ``prefill``, the workers of role prefill, and ``decode``, those of roles
decode and colocated (the workers that decode). A worker that is draining (changing its
role) is in neither: it is leaving the pool it was in and the router sends it nothing. For
each pool (:class:`PoolSignals`):

- ``queued_prompt_tokens``: prompt tokens queued for prefill there: what this router booked
  and has not seen prefilled (``WorkerLoad.pending_prefill_tokens``), plus the requests a
  worker reports waiting beyond this router's bookings (another router's), each counted at
  that worker's mean measured prompt;
- ``prefill_tokens_per_s``: the pool's measured prefill rate, the sum over its workers of the
  per-token rate learned from their finished requests (``WorkerLoad.prefill_cost``);
- ``predicted_ttft_s``: the queued tokens over that rate (the pool works its queue off in
  parallel), plus one prefill of the pool's mean measured prompt: what a new request of the
  usual size waits for its first token. The decode pool's counts the prefills its workers do
  themselves (``auto`` mode's local ones, colocated mode's);
- ``kv_utilization``: KV blocks in use over the pool's blocks (``WorkerLoad.free_blocks``: the
  worker's report or this router's bookings, whichever says more is used);
- ``itl_s``: the mean inter-token latency the router measured over the recent window, given
  by the caller and attributed to the decode pool: every token after a request's first comes
  from a decode-capable worker (where the router measures it, it does not know which one).
  None for the prefill pool, and without samples;
- ``prefilling``: how many of its workers are computing a prompt now: this router has more
  prefills booked there without their first token than the worker reports waiting (the rest
  of the booked ones are admitted, so computing; a request that waits for room in the KV
  cache is not prefill work), and ``prefill_busy``, the share of the pool's worker-time spent
  so over the recent window (the caller's average of ``prefilling / workers``; None before it
  has one): how much of the pool prefill takes, which in the colocated state is what a
  prefill pool of its own would take off the decodes;
- ``running`` / ``waiting``: what its workers last reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from router.workers.load import WorkerLoad

__all__ = ["POOLS", "Pool", "PoolSignals", "pool_of", "pool_signals"]

Pool = Literal["prefill", "decode"]
POOLS: tuple[Pool, ...] = ("prefill", "decode")


def pool_of(load: WorkerLoad) -> Pool | None:
    """The pool a worker is in (None while it drains)."""
    if load.info.draining:
        return None
    return "prefill" if load.info.role == "prefill" else "decode"


@dataclass(frozen=True)
class PoolSignals:
    """One pool's signals (module docstring). ``workers``: in the pool (not draining);
    ``draining``: workers that left it to change their role, not yet back."""

    pool: Pool
    workers: int
    draining: int
    queued_prompt_tokens: float
    prefill_tokens_per_s: float
    predicted_ttft_s: float
    kv_utilization: float
    itl_s: float | None
    running: int
    waiting: int
    prefilling: int = 0
    prefill_busy: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def _queued_tokens(w: WorkerLoad) -> float:
    mean = w.prefill_cost.mean_tokens
    others = w.figures.waiting - w.pending_prefills
    extra = others * (w.rates.pivot_tokens if mean is None else mean) if others > 0 else 0.0
    return w.pending_prefill_tokens + extra


def _computing_prefill(w: WorkerLoad) -> bool:
    """Whether one of this router's prefills there is admitted (so computing) now."""
    return w.pending_prefill_tokens > 0 and w.pending_prefills > w.figures.waiting


def _typical_prefill_s(loads: Sequence[WorkerLoad]) -> float:
    """One prefill of the pool's mean measured prompt (the rates' pivot before any sample),
    on its median worker."""
    sizes = [w.prefill_cost.mean_tokens for w in loads if w.prefill_cost.mean_tokens is not None]
    tokens = sum(sizes) / len(sizes) if sizes else loads[0].rates.pivot_tokens
    times = sorted(w.prefill_cost.seconds(tokens) for w in loads)
    return times[len(times) // 2]


def _one_pool(pool: Pool, loads: Sequence[WorkerLoad], draining: int, itl_s: float | None) -> PoolSignals:
    if not loads:
        return PoolSignals(pool, 0, draining, 0.0, 0.0, 0.0, 0.0, itl_s if pool == "decode" else None, 0, 0, 0)
    queued = sum(_queued_tokens(w) for w in loads)
    rate = sum(w.prefill_cost.tokens_per_s for w in loads)
    total = sum(w.figures.kv_total_blocks or w.info.kv_capacity_blocks for w in loads)
    free = sum(w.free_blocks for w in loads)
    return PoolSignals(
        pool=pool, workers=len(loads), draining=draining, queued_prompt_tokens=queued,
        prefill_tokens_per_s=rate, predicted_ttft_s=queued / rate + _typical_prefill_s(loads),
        kv_utilization=(total - free) / total if total else 0.0,
        itl_s=itl_s if pool == "decode" else None,
        running=sum(w.figures.running for w in loads), waiting=sum(w.figures.waiting for w in loads),
        prefilling=sum(_computing_prefill(w) for w in loads))


def pool_signals(loads: Sequence[WorkerLoad], itl_s: float | None) -> dict[Pool, PoolSignals]:
    """Every pool's signals from the workers' books; ``itl_s``: the router's recent ITL."""
    members: dict[Pool, list[WorkerLoad]] = {p: [] for p in POOLS}
    draining: dict[Pool, int] = {p: 0 for p in POOLS}
    for w in loads:
        pool = pool_of(w)
        if pool is None:
            draining["prefill" if w.info.role == "prefill" else "decode"] += 1
        else:
            members[pool].append(w)
    return {p: _one_pool(p, members[p], draining[p], itl_s) for p in POOLS}
