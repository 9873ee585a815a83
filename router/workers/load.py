"""The router's books on one worker: its reported load, its learned costs, what it holds.

:class:`WorkerLoad` is the router's live view of one worker: its :class:`WorkerInfo`, its last
reported :class:`LoadFigures`, a learned cost model of its prefill and of its store loads
(:class:`~router.workers.fit.LinearCost`), and what this router has sent it and not yet seen
finish (:class:`Assignment`: prefill tokens still queued there, KV blocks the request may
fill, from ``engine.api.blocks.blocks_needed``). The pool keeps one per worker and feeds it
the worker's load events; placement books requests on it and reads it (the TTFT estimate,
``router.placement.cost``, reads its costs and its queue; ``load``, ``free_blocks``; the
kv-aware choice counts in ``passed_over`` the times it passed the worker over while idle,
``router.placement.prefill``). Free blocks = total - max(reported used, blocks this router
reserved there).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from engine.api.events import LoadFigures
from engine.api.generate import RequestStats, WorkerInfo
from router.workers.fit import Ewma, LinearCost, RateConfig

__all__ = ["Assignment", "WorkerLoad", "peer_priors"]


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
    passed_over: int = 0     # times running the kv-aware choice passed it over while idle

    def __post_init__(self) -> None:
        r = self.rates
        self.prefill_rate = Ewma(r.prefill_tokens_per_s, r.alpha)
        self.load_rate = Ewma(r.load_tokens_per_s, r.alpha)
        fit = {"alpha": r.fit_alpha, "prior_weight": r.prior_weight, "pivot_tokens": r.pivot_tokens}
        self.prefill_cost = LinearCost(r.prefill_overhead_s, r.prefill_tokens_per_s,
                                       trusted=r.prefill_prior_measured, **fit)
        self.load_cost = LinearCost(r.load_overhead_s, r.load_tokens_per_s, trusted=r.load_prior_measured, **fit)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def observe_load(self, figures: LoadFigures) -> None:
        """A load event or snapshot from the worker: its queue, and its reported rates, which
        raise the prior rates when they are higher (never lower them: see ``router.workers.fit``)."""
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
    def load(self) -> int:
        """Queued + running requests: the worker's report or this router's count, the larger."""
        return max(self.figures.waiting + self.figures.running, self.inflight_requests)

    @property
    def free_blocks(self) -> int:
        total = self.figures.kv_total_blocks or self.info.kv_capacity_blocks
        used = max(total - self.figures.kv_free_blocks if self.figures.kv_total_blocks else 0,
                   self.reserved_blocks)
        return max(0, total - used)


def peer_priors(rates: RateConfig, peers: Iterable[WorkerLoad]) -> RateConfig:
    """A joining worker's priors: the median of what its peers' costs learned (those that have
    samples), else ``rates``. Its peers are the workers of its namespace (the same model,
    dtype and block size). Without this, a worker that joins a warm pool (a restart, a
    scale-up) is priced at the generic priors while its peers are priced at what they
    measured; where the model is faster than the priors say, the kv-aware choice never picks
    it, so it never measures itself: it starves. It learns its own costs from its first
    samples as any worker does, except that a priced-from-peers cost caps a stalled sample
    from the first (``prefill_prior_measured`` / ``load_prior_measured``): the first prompts
    of a restarted worker are the ones most likely to stall (cold, on a machine busy starting
    it), and one uncapped 0.4 s sample priced it out for good."""
    peers = list(peers)
    pre = [p.prefill_cost for p in peers if p.prefill_cost.samples]
    lo = [p.load_cost for p in peers if p.load_cost.samples]
    out = rates
    if pre:
        out = replace(out, prefill_tokens_per_s=1.0 / statistics.median(c.per_token_s for c in pre),
                      prefill_overhead_s=statistics.median(c.overhead_s for c in pre),
                      prefill_prior_measured=True)
    if lo:
        out = replace(out, load_tokens_per_s=1.0 / statistics.median(c.per_token_s for c in lo),
                      load_overhead_s=statistics.median(c.overhead_s for c in lo),
                      load_prior_measured=True)
    return out
