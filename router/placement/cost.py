"""The TTFT cost model: one worker's estimated time to first token for one prompt.

Pure arithmetic over a worker's books (:class:`~router.workers.load.WorkerLoad`: its learned
prefill and load costs, its queue) and the prompt's cache hits::

    prefill(n) = prefill overhead + n x prefill per-token cost       (LinearCost, learned)
    load(n)    = load overhead + n x load per-token cost  (0 when n = 0)
    queue_s    = booked prefill tokens x per-token cost + booked prefills x overhead
                 + (reported waiting - booked prefills, if more) x prefill(mean sample size)
    compute_s  = prefill(uncached tokens)
    load_s     = load(store-hit tokens)
    ttft_s     = queue_s + compute_s + load_s

with device-hit tokens = leading blocks in its device cache x block size, store-hit tokens =
leading blocks in the store beyond those, uncached = the rest (at least one token: the last
prompt token is always computed). "Booked" is what this router sent the worker whose first
token has not come back; "reported waiting" is the worker's own queue (every router's
requests), from its load events. How the costs are learned: ``router.workers.fit``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.workers.load import WorkerLoad

__all__ = ["PrefillEstimate", "estimate_prefill", "ttft_s", "ttft_each"]


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


def ttft_s(worker: WorkerLoad, num_tokens: int, device_blocks: int, store_blocks: int) -> float:
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


def ttft_each(workers: Sequence[WorkerLoad], num_tokens: int, device_blocks: Sequence[int],
              store_blocks: int) -> list[float]:
    """``[ttft_s(w, num_tokens, d, store_blocks) for w, d in zip(workers, device_blocks)]``,
    bit for bit, in one loop with no call per worker: a decision scores every candidate on
    every request. ``WorkerLoad.queue_s`` is inlined (the same arithmetic in the same order;
    tests/router/test_cost.py pins the two together)."""
    out: list[float] = []
    append, last = out.append, num_tokens - 1
    for w, d in zip(workers, device_blocks):
        c = w.prefill_cost
        per_token, pending = c.per_token_s, w.pending_prefills
        queue = w.pending_prefill_tokens * per_token + pending * c.overhead_s
        others = w.figures.waiting - pending
        if others > 0:
            mean = c.mean_tokens
            queue += others * c.seconds(w.rates.pivot_tokens if mean is None else mean)
        if num_tokens:
            bs = w.info.block_size
            device = d * bs
            if device > last:
                device = last
            cached = (d if d > store_blocks else store_blocks) * bs
            if cached > last:
                cached = last
            t = queue + (c.overhead_s + (num_tokens - cached) * per_token)
            if cached > device:   # store-hit tokens: a load
                lc = w.load_cost
                t += lc.overhead_s + (cached - device) * lc.per_token_s
        else:
            t = queue + (c.overhead_s + 0 * per_token)
        append(t)
    return out
