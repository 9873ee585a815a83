"""Where a request goes: prefill choice, decode choice, and the ``auto`` mode decision.

The inputs are plain figures, so every choice is a pure function of them (no I/O):

- :class:`WorkerLoad`: the router's live view of one worker: its :class:`WorkerInfo`, its last
  reported :class:`LoadFigures`, moving (EWMA) measurements of its prefill and store-load
  rates, and what this router has sent it and not yet seen finish (:class:`Assignment`).
- the prompt's block keys, matched against :class:`~router.kv_index.KvIndex` (device tier),
  and the number of leading blocks the store holds (``store_blocks``, from
  ``kvstore`` ``prefix_len`` asked by the caller: a :data:`StorePrefixFn`).

Estimated time to first token on a prefill worker (``kv-aware``)::

    queue_s   = pending prefill tokens this router sent there / prefill rate
    compute_s = uncached tokens / prefill rate
    load_s    = store-hit tokens / store-load rate
    ttft_s    = queue_s + compute_s + load_s

with device-hit tokens = leading blocks in its device cache × block size, store-hit tokens =
leading blocks in the store beyond those, uncached = the rest (at least one token: the last
prompt token is always computed). Rates come from the workers' load events and from the
stats of finished requests, smoothed by an EWMA; until a worker has measured a rate the
configured prior is used. ``least-loaded`` picks the fewest queued+running requests;
``round-robin`` rotates. Ties break on worker id, so choices are deterministic.

Decode choice: among decode-capable workers, those with enough free KV blocks for
``prompt + max_tokens`` (free = total - max(reported used, blocks this router reserved
there)), then the least loaded. None when no worker fits (the caller answers 503 or waits).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from engine.api_types import LoadFigures, RequestStats, WorkerInfo
from router.kv_index import KvIndex

__all__ = [
    "PrefillPolicyName",
    "StorePrefixFn",
    "RateConfig",
    "Ewma",
    "Assignment",
    "WorkerLoad",
    "PrefillEstimate",
    "PrefillPolicy",
    "choose_decode",
    "blocks_needed",
    "prefer_local",
]

PrefillPolicyName = Literal["kv-aware", "least-loaded", "round-robin"]
PREFILL_POLICIES: tuple[str, ...] = ("kv-aware", "least-loaded", "round-robin")

StorePrefixFn = Callable[[Sequence[bytes]], int]
"""Leading blocks of these keys the store holds (``kvstore`` client ``prefix_len``)."""


@dataclass(frozen=True, slots=True)
class RateConfig:
    """Priors used until a worker has measured a rate, and the EWMA weight of a sample."""

    prefill_tokens_per_s: float = 2_000.0
    load_tokens_per_s: float = 50_000.0
    alpha: float = 0.3

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.load_tokens_per_s <= 0:
            raise ValueError("rate priors must be positive")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")


class Ewma:
    """Exponentially weighted moving average; ``value`` is the prior until the first sample."""

    __slots__ = ("alpha", "prior", "samples", "_value")

    def __init__(self, prior: float, alpha: float) -> None:
        self.alpha, self.prior, self.samples = alpha, prior, 0
        self._value = prior

    @property
    def value(self) -> float:
        return self._value

    def update(self, sample: float) -> None:
        """Add a sample; non-positive or non-finite samples ("not measured") are ignored."""
        if not (sample > 0.0 and math.isfinite(sample)):
            return
        self._value = sample if self.samples == 0 else (
            self.alpha * sample + (1.0 - self.alpha) * self._value
        )
        self.samples += 1


@dataclass(eq=False, slots=True)
class Assignment:
    """What one request holds on one worker in the router's books. ``prefill_done`` when its
    first token arrived (its prompt no longer queues there), ``release`` when it ended.
    Both idempotent, so ``finally: a.release()`` is always safe."""

    worker: WorkerLoad
    prefill_tokens: int
    blocks: int
    _prefilling: bool = True
    _live: bool = True

    def prefill_done(self) -> None:
        if self._prefilling:
            self._prefilling = False
            self.worker.pending_prefill_tokens -= self.prefill_tokens

    def release(self) -> None:
        if self._live:
            self.prefill_done()
            self._live = False
            self.worker.inflight_requests -= 1
            self.worker.reserved_blocks -= self.blocks


@dataclass(eq=False)
class WorkerLoad:
    """The router's live view of one worker (see the module docstring)."""

    info: WorkerInfo
    rates: RateConfig = field(default_factory=RateConfig)
    figures: LoadFigures = field(default_factory=LoadFigures)
    pending_prefill_tokens: int = 0
    inflight_requests: int = 0
    reserved_blocks: int = 0

    def __post_init__(self) -> None:
        self.prefill_rate = Ewma(self.rates.prefill_tokens_per_s, self.rates.alpha)
        self.load_rate = Ewma(self.rates.load_tokens_per_s, self.rates.alpha)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def observe_load(self, figures: LoadFigures) -> None:
        """A load event or snapshot from the worker."""
        self.figures = figures
        self.prefill_rate.update(figures.prefill_tokens_per_s)
        self.load_rate.update(figures.load_tokens_per_s)

    def observe_stats(self, stats: RequestStats) -> None:
        """A finished request's stats: direct samples of both rates."""
        if stats.computed_prompt_tokens and stats.prefill_s > 0:
            self.prefill_rate.update(stats.computed_prompt_tokens / stats.prefill_s)
        if stats.store_hit_tokens and stats.store_load_s > 0:
            self.load_rate.update(stats.store_hit_tokens / stats.store_load_s)

    def assign(self, prefill_tokens: int = 0, blocks: int = 0) -> Assignment:
        """Book a request here: ``prefill_tokens`` it will compute, ``blocks`` it may fill."""
        self.pending_prefill_tokens += prefill_tokens
        self.inflight_requests += 1
        self.reserved_blocks += blocks
        return Assignment(self, prefill_tokens, blocks)

    @property
    def load(self) -> int:
        """Queued + running requests: the worker's report or this router's count, the larger."""
        return max(self.figures.waiting + self.figures.running, self.inflight_requests)

    @property
    def free_blocks(self) -> int:
        total = self.figures.kv_total_blocks or self.info.kv_capacity_blocks
        used = max(total - self.figures.kv_free_blocks if self.figures.kv_total_blocks else 0,
                   self.reserved_blocks)
        return max(0, total - used)


@dataclass(frozen=True, slots=True)
class PrefillEstimate:
    """One worker's estimated time to first token for one prompt, with its parts."""

    worker_id: str
    device_hit_tokens: int
    store_hit_tokens: int
    uncached_tokens: int
    queue_s: float
    compute_s: float
    load_s: float

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.compute_s + self.load_s


def _split(block_size: int, num_tokens: int, device_blocks: int, store_blocks: int
           ) -> tuple[int, int, int]:
    """(device-hit, store-hit, uncached) tokens; the last prompt token is always computed."""
    if not num_tokens:
        return 0, 0, 0
    last = num_tokens - 1
    device = min(device_blocks * block_size, last)
    cached = min((device_blocks if device_blocks > store_blocks else store_blocks) * block_size, last)
    return device, cached - device, num_tokens - cached


def estimate_prefill(
    worker: WorkerLoad, num_tokens: int, device_blocks: int, store_blocks: int
) -> PrefillEstimate:
    """The TTFT estimate of ``worker`` for a prompt of ``num_tokens`` tokens."""
    device, store, uncached = _split(worker.info.block_size, num_tokens, device_blocks, store_blocks)
    prefill_rate, load_rate = worker.prefill_rate.value, worker.load_rate.value
    return PrefillEstimate(
        worker_id=worker.worker_id,
        device_hit_tokens=device,
        store_hit_tokens=store,
        uncached_tokens=uncached,
        queue_s=worker.pending_prefill_tokens / prefill_rate,
        compute_s=uncached / prefill_rate,
        load_s=store / load_rate,
    )


def _ttft_s(worker: WorkerLoad, num_tokens: int, device_blocks: int, store_blocks: int) -> float:
    """``estimate_prefill(...).ttft_s`` (the same arithmetic, in the same order) without
    building the estimate: the hot path scores every candidate and builds one estimate."""
    if num_tokens:
        bs, last = worker.info.block_size, num_tokens - 1
        device = min(device_blocks * bs, last)
        cached = min((device_blocks if device_blocks > store_blocks else store_blocks) * bs, last)
        store, uncached = cached - device, num_tokens - cached
    else:
        store = uncached = 0
    prefill_rate = worker.prefill_rate.value
    return (worker.pending_prefill_tokens / prefill_rate + uncached / prefill_rate
            + store / worker.load_rate.value)


class PrefillPolicy:
    """Chooses the prefill worker for a prompt (see the module docstring)."""

    def __init__(self, name: PrefillPolicyName, index: KvIndex) -> None:
        if name not in PREFILL_POLICIES:
            raise ValueError(f"unknown prefill policy {name!r}; choose one of {PREFILL_POLICIES}")
        self.name = name
        self._index = index
        self._counter = itertools.count()

    def estimates(
        self, candidates: Sequence[WorkerLoad], keys: Sequence[bytes], num_tokens: int,
        store_blocks: int = 0,
    ) -> list[PrefillEstimate]:
        """Every candidate's estimate (one index walk for all of them)."""
        matches = self._index.match(keys, [w.worker_id for w in candidates])
        return [estimate_prefill(w, num_tokens, matches[w.worker_id], store_blocks)
                for w in candidates]

    def choose(
        self, candidates: Sequence[WorkerLoad], keys: Sequence[bytes], num_tokens: int,
        store_blocks: int = 0,
    ) -> tuple[WorkerLoad, PrefillEstimate] | None:
        """The chosen worker and its estimate; None when there is no candidate."""
        if not candidates:
            return None
        if self.name == "round-robin":
            ordered = sorted(candidates, key=lambda w: w.worker_id)
            w = ordered[next(self._counter) % len(ordered)]
            return w, self._estimate(w, keys, num_tokens, store_blocks)
        # One index walk, then a float per candidate; the minimum of (primary, secondary,
        # worker id) is what sorting by worker id and taking the first minimum would give.
        matches = self._index.match(keys, [w.worker_id for w in candidates])
        best, best_ttft = None, 0.0
        for w in candidates:
            ttft = _ttft_s(w, num_tokens, matches[w.worker_id], store_blocks)
            if best is None:
                best, best_ttft = w, ttft
            elif self.name == "kv-aware":
                if ttft < best_ttft or (ttft == best_ttft and (w.load, w.worker_id) < (best.load, best.worker_id)):
                    best, best_ttft = w, ttft
            elif (w.load, ttft, w.worker_id) < (best.load, best_ttft, best.worker_id):
                best, best_ttft = w, ttft
        assert best is not None
        return best, estimate_prefill(best, num_tokens, matches[best.worker_id], store_blocks)

    def _estimate(self, w: WorkerLoad, keys: Sequence[bytes], num_tokens: int,
                  store_blocks: int) -> PrefillEstimate:
        return estimate_prefill(w, num_tokens, self._index.match(keys, [w.worker_id])[w.worker_id],
                                store_blocks)


def blocks_needed(num_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a request can fill: its prompt plus every token it may generate."""
    return -(-(num_tokens + max_tokens) // block_size)


def choose_decode(
    candidates: Sequence[WorkerLoad], num_tokens: int, max_tokens: int
) -> WorkerLoad | None:
    """Enough free KV blocks first, then least loaded, then the most free blocks."""
    fitting = [
        w for w in candidates
        if w.free_blocks >= blocks_needed(num_tokens, max_tokens, w.info.block_size)
    ]
    if not fitting:
        return None
    return min(fitting, key=lambda w: (w.load, -w.free_blocks, w.worker_id))


def prefer_local(estimate: PrefillEstimate, threshold_tokens: int) -> bool:
    """``auto`` mode: prefill on the decode worker itself when the part it would compute is
    short (below ``threshold_tokens``); a transfer through the store would cost more."""
    return estimate.uncached_tokens < threshold_tokens
