"""Where a request goes: prefill choice, decode choice, and the ``auto`` mode decision.

The inputs are plain figures, so every choice is a pure function of them (no I/O):

- :class:`WorkerLoad`: the router's live view of one worker: its :class:`WorkerInfo`, its last
  reported :class:`LoadFigures`, a learned cost model of its prefill and of its store loads
  (:class:`LinearCost`), and what this router has sent it and not yet seen finish
  (:class:`Assignment`).
- the prompt's block keys, matched against :class:`~router.placement.kv_index.KvIndex` (device tier),
  and the number of leading blocks the store holds (``store_blocks``, from
  ``kvstore`` ``prefix_len`` asked by the caller: a :data:`StorePrefixFn`).

Estimated time to first token on a prefill worker (``kv-aware``)::

    prefill(n) = prefill overhead + n x prefill per-token cost       (LinearCost, learned)
    load(n)    = load overhead + n x load per-token cost  (0 when n = 0)
    queue_s    = booked prefill tokens x per-token cost + booked prefills x overhead
                 + (reported waiting - booked prefills, if more) x prefill(mean sample size)
    compute_s  = prefill(uncached tokens)
    load_s     = load(store-hit tokens)
    ttft_s     = queue_s + compute_s + load_s

with device-hit tokens = leading blocks in its device cache × block size, store-hit tokens =
leading blocks in the store beyond those, uncached = the rest (at least one token: the last
prompt token is always computed). "Booked" is what this router sent the worker whose first
token has not come back; "reported waiting" is the worker's own queue (every router's
requests), from its load events.

Why a fixed overhead: a prefill's time is per-request and per-step overhead plus a per-token
cost. A rate measured on short prompts is mostly overhead, so a worker that served short
prompts looks many times slower per token than it is, and a worker holding most of a long
prompt's prefix would lose to one that holds nothing. Each worker's two costs are fitted
online to its own finished requests (``prefill_s - store_load_s`` against
``computed_prompt_tokens``; ``store_load_s`` against ``store_hit_tokens``): an exponentially
weighted least-squares line (a sample's weight decays by ``1 - fit_alpha`` per newer
sample) pulled toward the configured priors (ridge, worth ``prior_weight`` samples, with
tokens scaled by ``pivot_tokens``). So samples at one size fix only the line's height
there: samples far below ``pivot_tokens`` tokens move the overhead and keep the prior rate,
samples far above it move the rate and keep the prior overhead, and samples that spread
over sizes fit both. The fit is clamped to overhead >= 0 and a rate in [1, 1e9] tokens/s.
The rates a worker reports in its load events are per-step figures that overhead can only
make look slower: one above the configured prior raises the prior rate (a worker known to
be fast before this router sent it anything), never lowers it. ``least-loaded`` picks the
fewest queued+running requests; ``round-robin`` rotates. Ties break on worker id, so
choices are deterministic.

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

from engine.api.generate import RequestStats, WorkerInfo
from engine.api.events import LoadFigures
from router.placement.kv_index import KvIndex

__all__ = [
    "PrefillPolicyName",
    "StorePrefixFn",
    "RateConfig",
    "Ewma",
    "LinearCost",
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
    """Priors of the cost models and how fast they learn (see the module docstring).

    ``alpha`` is the EWMA weight of a rate reported in a load event; ``fit_alpha`` how fast
    the time-vs-tokens fits forget (a sample's weight decays by ``1 - fit_alpha`` per newer
    sample); ``prior_weight`` how many samples the priors are worth; ``pivot_tokens`` the
    prompt size below which a sample mostly teaches the overhead, above it the rate.
    """

    prefill_tokens_per_s: float = 2_000.0
    load_tokens_per_s: float = 50_000.0
    alpha: float = 0.3
    prefill_overhead_s: float = 0.01
    load_overhead_s: float = 0.002
    fit_alpha: float = 0.1
    prior_weight: float = 0.1
    pivot_tokens: float = 256.0

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.load_tokens_per_s <= 0:
            raise ValueError("rate priors must be positive")
        if self.prefill_overhead_s < 0 or self.load_overhead_s < 0:
            raise ValueError("overhead priors must be >= 0")
        for name in ("alpha", "fit_alpha"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.prior_weight <= 0 or self.pivot_tokens <= 0:
            raise ValueError("prior_weight and pivot_tokens must be positive")


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


_MIN_PER_TOKEN_S = 1e-9   # 1e9 tokens/s
_MAX_PER_TOKEN_S = 1.0    # 1 token/s


class LinearCost:
    """``seconds(n) = overhead_s + n * per_token_s``, fitted to (tokens, seconds) samples.

    Exponentially weighted least squares with a ridge pull toward the prior line: minimizes
    ``sum w_i (t_i - a - b n_i)^2 + k ((a - a0)^2 + (N (b - b0))^2)`` where ``w_i`` decays by
    ``1 - alpha`` per newer sample, ``k`` is ``prior_weight`` and ``N`` ``pivot_tokens``.
    The fit is refreshed on every sample (a 2x2 solve), so reading it costs two attribute
    loads. Clamped to ``overhead_s >= 0`` and ``per_token_s`` in [1e-9, 1] s.
    """

    __slots__ = ("overhead_s", "per_token_s", "samples", "prior_overhead_s", "prior_per_token_s",
                 "_keep", "_k", "_kn2", "_s0", "_sn", "_st", "_snn", "_snt")

    def __init__(self, overhead_s: float, tokens_per_s: float, *, alpha: float = 0.1,
                 prior_weight: float = 0.1, pivot_tokens: float = 256.0) -> None:
        if tokens_per_s <= 0 or overhead_s < 0 or not 0.0 < alpha <= 1.0:
            raise ValueError("LinearCost needs overhead_s >= 0, tokens_per_s > 0, alpha in (0, 1]")
        self.prior_overhead_s, self.prior_per_token_s = overhead_s, 1.0 / tokens_per_s
        self._keep, self._k, self._kn2 = 1.0 - alpha, prior_weight, prior_weight * pivot_tokens ** 2
        self._s0 = self._sn = self._st = self._snn = self._snt = 0.0
        self.samples = 0
        self.overhead_s, self.per_token_s = overhead_s, self.prior_per_token_s
        self._fit()

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.per_token_s

    @property
    def mean_tokens(self) -> float | None:
        """The weighted mean size of the samples (None before the first)."""
        return self._sn / self._s0 if self.samples else None

    def seconds(self, tokens: float) -> float:
        return self.overhead_s + tokens * self.per_token_s

    def set_prior_rate(self, tokens_per_s: float) -> None:
        """Move the prior per-token cost (the fit is pulled toward it); ignores non-positive."""
        if tokens_per_s > 0.0 and math.isfinite(tokens_per_s) and 1.0 / tokens_per_s != self.prior_per_token_s:
            self.prior_per_token_s = 1.0 / tokens_per_s
            self._fit()

    def update(self, tokens: float, seconds: float) -> None:
        """Add a measurement; one without tokens or time ("not measured") is ignored."""
        if not (tokens > 0 and seconds > 0.0 and math.isfinite(seconds) and math.isfinite(tokens)):
            return
        keep = self._keep
        self._s0 = self._s0 * keep + 1.0
        self._sn = self._sn * keep + tokens
        self._st = self._st * keep + seconds
        self._snn = self._snn * keep + tokens * tokens
        self._snt = self._snt * keep + tokens * seconds
        self.samples += 1
        self._fit()

    def _fit(self) -> None:
        k, kn2, a0, b0 = self._k, self._kn2, self.prior_overhead_s, self.prior_per_token_s
        if not self.samples:
            self.overhead_s, self.per_token_s = a0, b0
            return
        # Normal equations of the ridge fit: [[s0+k, sn], [sn, snn+kN^2]] [a, b] = [st+k a0, snt+kN^2 b0]
        m00, m01, m11 = self._s0 + k, self._sn, self._snn + kn2
        r0, r1 = self._st + k * a0, self._snt + kn2 * b0
        det = m00 * m11 - m01 * m01
        a, b = (r0 * m11 - m01 * r1) / det, (m00 * r1 - m01 * r0) / det
        if a < 0.0:           # no negative overhead: the best line with a = 0
            a, b = 0.0, r1 / m11
        if not _MIN_PER_TOKEN_S <= b <= _MAX_PER_TOKEN_S:
            b = min(max(b, _MIN_PER_TOKEN_S), _MAX_PER_TOKEN_S)
            a = max(0.0, (r0 - m01 * b) / m00)   # the best overhead for the clamped slope
        self.overhead_s, self.per_token_s = a, b


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
            if self.prefill_tokens:
                self.worker.pending_prefills -= 1

    def release(self) -> None:
        if self._live:
            self.prefill_done()
            self._live = False
            self.worker.inflight_requests -= 1
            self.worker.reserved_blocks -= self.blocks


@dataclass(eq=False)
class WorkerLoad:
    """The router's live view of one worker (see the module docstring).

    ``prefill_rate`` and ``load_rate`` are EWMAs of the rates the worker reports (a prior
    until it reports one); ``prefill_cost`` and ``load_cost`` are the learned models the
    estimate uses."""

    info: WorkerInfo
    rates: RateConfig = field(default_factory=RateConfig)
    figures: LoadFigures = field(default_factory=LoadFigures)
    pending_prefill_tokens: int = 0
    pending_prefills: int = 0
    inflight_requests: int = 0
    reserved_blocks: int = 0

    def __post_init__(self) -> None:
        r = self.rates
        self.prefill_rate = Ewma(r.prefill_tokens_per_s, r.alpha)
        self.load_rate = Ewma(r.load_tokens_per_s, r.alpha)
        fit = {"alpha": r.fit_alpha, "prior_weight": r.prior_weight, "pivot_tokens": r.pivot_tokens}
        self.prefill_cost = LinearCost(r.prefill_overhead_s, r.prefill_tokens_per_s, **fit)
        self.load_cost = LinearCost(r.load_overhead_s, r.load_tokens_per_s, **fit)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def observe_load(self, figures: LoadFigures) -> None:
        """A load event or snapshot from the worker: its queue, and its reported rates, which
        raise the prior rates when they are higher (never lower them: see the module doc)."""
        self.figures = figures
        self.prefill_rate.update(figures.prefill_tokens_per_s)
        self.load_rate.update(figures.load_tokens_per_s)
        r = self.rates
        self.prefill_cost.set_prior_rate(max(r.prefill_tokens_per_s, self.prefill_rate.value))
        self.load_cost.set_prior_rate(max(r.load_tokens_per_s, self.load_rate.value))

    def observe_stats(self, stats: RequestStats) -> None:
        """A finished phase's stats: one (tokens, seconds) sample of each cost. The engine's
        ``prefill_s`` (first scheduled to first token) includes the store loads it waited on,
        so those are taken out of the compute sample."""
        if stats.computed_prompt_tokens and stats.prefill_s > 0:
            self.prefill_cost.update(stats.computed_prompt_tokens,
                                     stats.prefill_s - stats.store_load_s)
        if stats.store_hit_tokens and stats.store_load_s > 0:
            self.load_cost.update(stats.store_hit_tokens, stats.store_load_s)

    def assign(self, prefill_tokens: int = 0, blocks: int = 0) -> Assignment:
        """Book a request here: ``prefill_tokens`` it will compute, ``blocks`` it may fill."""
        self.pending_prefill_tokens += prefill_tokens
        if prefill_tokens:
            self.pending_prefills += 1
        self.inflight_requests += 1
        self.reserved_blocks += blocks
        return Assignment(self, prefill_tokens, blocks)

    @property
    def queue_s(self) -> float:
        """Estimated wait before a new prefill starts here: the prefills this router booked
        (their tokens and their overheads), plus requests the worker reports waiting beyond
        those (other routers'), each costed as a prefill of the mean measured size."""
        c = self.prefill_cost
        wait = self.pending_prefill_tokens * c.per_token_s + self.pending_prefills * c.overhead_s
        others = self.figures.waiting - self.pending_prefills
        if others > 0:
            mean = c.mean_tokens
            wait += others * c.seconds(self.rates.pivot_tokens if mean is None else mean)
        return wait

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
    c, lc = worker.prefill_cost, worker.load_cost
    return PrefillEstimate(
        worker_id=worker.worker_id,
        device_hit_tokens=device,
        store_hit_tokens=store,
        uncached_tokens=uncached,
        queue_s=worker.queue_s,
        compute_s=c.overhead_s + uncached * c.per_token_s,
        load_s=lc.overhead_s + store * lc.per_token_s if store else 0.0,
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
    c, lc = worker.prefill_cost, worker.load_cost
    return (worker.queue_s + (c.overhead_s + uncached * c.per_token_s)
            + (lc.overhead_s + store * lc.per_token_s if store else 0.0))


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
