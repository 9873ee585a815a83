"""The desired worker count of each pool: a pure state machine with hysteresis and a cool-down.

Each pool has a *pressure*, its signal over its objective (``ScalingConfig``), where 1 is "at
the objective":

- prefill: ``predicted_ttft_s / ttft_target_s`` of the prefill pool. With no prefill pool
  (the colocated state: the decode workers prefill their own requests) the larger of the
  decode pool's (its predicted TTFT counts those prefills) and, while the decodes miss their
  objective (the decode pressure, below), its ``prefill_busy / prefill_share_target``
  (``min`` of the two): prefill taking that share of the decode workers' time is what stalls
  their decodes, which a prefill pool of its own takes away; decodes that keep their
  objective are no reason to split;
- decode: ``max(itl_s / itl_target_s, kv_utilization / kv_target)``.

What each evaluation proposes, for a pool of ``n`` workers at pressure ``p``:

- ``p >= 1``: more, ``max(n + 1, ceil(n * p))`` (the pool's work spread so that each worker
  is back at the objective; a pool of none gets one);
- ``n >= 2`` and ``p * n / (n - 1) <= down_ratio``: one fewer (even without that worker, the
  pool would stay well below its objective);
- the prefill pool of one worker, colocation allowed (the router's ``auto`` mode), ``p <
  1``, and the prefill share the merged pool would carry (both pools' ``prefill_busy``
  weighted by their workers) at most ``down_ratio * prefill_share_target``: none, the
  colocated state; from none, one again at ``p >= 1`` (so the band is the same one);
- otherwise ``n``.

The hysteresis: between ``down_ratio`` and 1 nothing is proposed; a proposal must stand at
every evaluation for ``up_for_s`` (more) or ``down_for_s`` (fewer) before the desired count
follows it (a load that crosses a threshold and comes back restarts the wait); after every
change of the desired count nothing moves for ``cooldown_s``. Whenever the pool's actual
count changes (an autoscaler acted, a worker died or changed its role), the desired count is
that count again and nothing moves for ``cooldown_s``: the new capacity is measured before
the next decision, and a count nobody acted on is not left standing. Time comes from the
caller (``now``), so tests drive it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from router.scaling.signals import POOLS, Pool, PoolSignals

__all__ = ["ScalingConfig", "SCALING_FLAGS", "PoolPolicy", "Planner", "Decision", "pressures", "merged_share"]

Direction = Literal[-1, 0, 1]


@dataclass(frozen=True)
class ScalingConfig:
    """The objectives and the hysteresis (module docstring); defaults in one place."""

    ttft_target_s: float = 2.0       # the prefill pool's objective: predicted TTFT
    itl_target_s: float = 0.15       # the decode pool's: mean inter-token latency ...
    kv_target: float = 0.8           # ... and KV-cache utilization
    down_ratio: float = 0.6          # fewer when the pressure without one worker stays at most this
    prefill_share_target: float = 0.3  # colocated: the prefill share of the decode workers' time
    up_for_s: float = 10.0           # a proposal of more must stand this long
    down_for_s: float = 30.0         # one of fewer, this long
    cooldown_s: float = 30.0         # nothing moves this long after a change
    window_s: float = 20.0           # the ITL is averaged over this many seconds
    interval_s: float = 1.0          # the router evaluates this often

    def __post_init__(self) -> None:
        for name in ("ttft_target_s", "itl_target_s", "kv_target", "interval_s", "window_s",
                     "prefill_share_target"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.down_ratio < 1:
            raise ValueError(f"need 0 < down_ratio < 1 (the hysteresis band is [down_ratio, 1]), "
                             f"got {self.down_ratio}")
        if min(self.up_for_s, self.down_for_s, self.cooldown_s) < 0:
            raise ValueError("up_for_s, down_for_s and cooldown_s must be >= 0")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


SCALING_FLAGS = (   # (flag, ScalingConfig field, help): kvrouter serve/up's --scale-*, kvplan's too
    ("--scale-ttft-target", "ttft_target_s", "the prefill pool's objective: predicted TTFT, seconds"),
    ("--scale-itl-target", "itl_target_s", "the decode pool's objective: mean inter-token latency, seconds"),
    ("--scale-kv-target", "kv_target", "the decode pool's objective: KV-cache utilization (0..1)"),
    ("--scale-down-ratio", "down_ratio", "a pool loses a worker when its pressure without it stays at most this"),
    ("--scale-prefill-share", "prefill_share_target", "the colocated state's objective: the share of the "
                                                      "decode workers' time prefill may take before a "
                                                      "prefill worker is split off (auto mode)"),
    ("--scale-up-for", "up_for_s", "seconds a proposal of more workers must stand before it is desired"),
    ("--scale-down-for", "down_for_s", "seconds a proposal of fewer workers must stand"),
    ("--scale-cooldown", "cooldown_s", "seconds nothing moves after a pool's count or desired count changed"),
    ("--scale-window", "window_s", "seconds the inter-token latency is averaged over"),
    ("--scale-interval", "interval_s", "seconds between the router's evaluations"),
)


def pressures(signals: dict[Pool, PoolSignals], config: ScalingConfig) -> dict[Pool, float]:
    """Each pool's pressure (module docstring)."""
    pre, dec = signals["prefill"], signals["decode"]
    itl = dec.itl_s or 0.0
    decode = max(itl / config.itl_target_s, dec.kv_utilization / config.kv_target)
    if pre.workers:
        prefill = pre.predicted_ttft_s / config.ttft_target_s
    else:
        prefill = max(dec.predicted_ttft_s / config.ttft_target_s,
                      min(decode, (dec.prefill_busy or 0.0) / config.prefill_share_target))
    return {"prefill": prefill, "decode": decode}


def merged_share(signals: dict[Pool, PoolSignals]) -> float:
    """The prefill share of worker-time the pools would have as one (the colocated state)."""
    pre, dec = signals["prefill"], signals["decode"]
    n = pre.workers + dec.workers
    if not n:
        return 0.0
    return ((pre.prefill_busy or 0.0) * pre.workers + (dec.prefill_busy or 0.0) * dec.workers) / n


@dataclass(frozen=True)
class Decision:
    """One pool's outcome of an evaluation: the desired count, what was proposed, the
    pressure behind it, and what holds it (``cooldown``, ``waiting up 4.0/10 s``, ...)."""

    pool: Pool
    workers: int
    desired: int
    proposed: int
    pressure: float
    state: str

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "pressure": round(self.pressure, 4)}


@dataclass
class PoolPolicy:
    """One pool's state machine (module docstring). ``min_workers``: the least it may be
    proposed (1 for decode; for prefill 0 when colocation is allowed, else 1)."""

    pool: Pool
    config: ScalingConfig
    min_workers: int = 0
    desired: int | None = None
    _observed: int | None = None
    _quiet_until: float = -math.inf
    _pending: tuple[Direction, float] | None = None
    _last: Decision | None = field(default=None, repr=False)

    def propose(self, n: int, pressure: float, may_merge: bool = False) -> int:
        """What this evaluation proposes for ``n`` workers at ``pressure``; ``may_merge``: the
        merged pool's prefill share would be low enough for a lone prefill worker to go."""
        c = self.config
        if pressure >= 1.0:
            out = max(n + 1, math.ceil(n * pressure - 1e-9))
        elif n >= 2 and pressure * n / (n - 1) <= c.down_ratio:
            out = n - 1
        elif n == 1 and self.pool == "prefill" and self.min_workers == 0 and may_merge:
            out = 0
        else:
            out = n
        return max(out, self.min_workers)

    def step(self, now: float, n: int, pressure: float, may_merge: bool = False) -> Decision:
        """One evaluation at time ``now`` with ``n`` workers in the pool now."""
        c = self.config
        if self.desired is None or n != self._observed:
            if self._observed is not None:   # capacity changed: measure it before deciding
                self._quiet_until = max(self._quiet_until, now + c.cooldown_s)
            self.desired = max(n, self.min_workers)
            self._observed, self._pending = n, None
        proposed = self.propose(n, pressure, may_merge)
        if now < self._quiet_until:
            self._pending = None
            return self._decide(n, proposed, pressure, f"cooldown {self._quiet_until - now:.1f} s")
        direction: Direction = 1 if proposed > self.desired else -1 if proposed < self.desired else 0
        if direction == 0:
            self._pending = None
            return self._decide(n, proposed, pressure, "steady")
        if self._pending is None or self._pending[0] != direction:
            self._pending = (direction, now)
        waited = now - self._pending[1]
        need = c.up_for_s if direction > 0 else c.down_for_s
        if waited < need:
            return self._decide(n, proposed, pressure,
                                f"waiting {'up' if direction > 0 else 'down'} {waited:.1f}/{need:g} s")
        self.desired, self._pending = proposed, None
        self._quiet_until = now + c.cooldown_s
        return self._decide(n, proposed, pressure, "changed")

    def _decide(self, n: int, proposed: int, pressure: float, state: str) -> Decision:
        assert self.desired is not None
        self._last = Decision(self.pool, n, self.desired, proposed, pressure, state)
        return self._last


class Planner:
    """Both pools' policies; ``evaluate(now, signals)`` is one evaluation. ``colocated_ok``:
    the prefill pool may go to none (the router's ``auto`` mode, where decode workers
    prefill their own requests when no prefill worker is there). In ``colocated`` mode
    (``prefill_used`` False) the prefill pool is never asked for."""

    def __init__(self, config: ScalingConfig, *, colocated_ok: bool = True,
                 prefill_used: bool = True) -> None:
        self.config = config
        self.prefill_used = prefill_used
        self.policies = {
            "prefill": PoolPolicy("prefill", config, min_workers=0 if colocated_ok or not prefill_used else 1),
            "decode": PoolPolicy("decode", config, min_workers=1)}

    def evaluate(self, now: float, signals: dict[Pool, PoolSignals]) -> dict[Pool, Decision]:
        c = self.config
        p = pressures(signals, c)
        may_merge = merged_share(signals) <= c.down_ratio * c.prefill_share_target
        out: dict[Pool, Decision] = {}
        for pool in POOLS:
            n = signals[pool].workers
            if pool == "prefill" and not self.prefill_used:
                out[pool] = Decision(pool, n, 0, 0, p[pool], "not used in colocated mode")
                continue
            out[pool] = self.policies[pool].step(now, n, p[pool], may_merge and pool == "prefill")
        return out
