"""The TTFT cost model: one worker's estimated time to first token for one prompt.

Pure arithmetic over a worker's books (:class:`~router.workers.load.WorkerLoad`: its learned
prefill and load costs, its queue) and the prompt's cache hits::

    prefill(n) = prefill overhead + n x prefill per-token cost       (LinearCost, learned)
    load(n)    = load overhead + n x load per-token cost  (0 when n = 0)
    queue_s    = booked prefill tokens x per-token cost + booked prefills x overhead
                 + (reported waiting - booked prefills, if more) x prefill(mean sample size,
                                                                   the pivot before a sample)
    compute_s  = prefill(uncached tokens)
    load_s     = load(store-hit tokens)
    ttft_s     = queue_s + compute_s + load_s

with device-hit tokens = leading blocks in its device cache x block size, store-hit tokens =
leading blocks in the store beyond those, uncached = the rest (at least one token: the last
prompt token is always computed). "Booked" is what this router sent the worker whose first
token has not come back; "reported waiting" is the worker's own queue (every router's
requests), from its load events. How the costs are learned: ``router.workers.fit``.

All of it is :func:`estimate_prefill`, the one place it is written; the prefill choice
(``router.placement.prefill.PrefillPolicy.choose``) asks it about every candidate.
"""

from __future__ import annotations

from typing import NamedTuple

from router.workers.load import WorkerLoad

__all__ = ["PrefillEstimate", "estimate_prefill"]


class PrefillEstimate(NamedTuple):
    """One worker's estimated time to first token for one prompt, with its parts (immutable;
    a tuple, cheap to build: a decision builds one per candidate)."""

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


def estimate_prefill(
    worker: WorkerLoad, num_tokens: int, device_blocks: int, store_blocks: int
) -> PrefillEstimate:
    """The TTFT estimate of ``worker`` for a prompt of ``num_tokens`` tokens whose first
    ``device_blocks`` blocks are in its device cache and first ``store_blocks`` in the store
    (the module docstring has the arithmetic)."""
    c = worker.prefill_cost
    per_token, overhead, booked = c.per_token_s, c.overhead_s, worker.pending_prefills
    queue = worker.pending_prefill_tokens * per_token + booked * overhead
    others = worker.figures.waiting - booked
    if others > 0:
        mean = c.mean_tokens
        queue += others * (overhead + (worker.rates.pivot_tokens if mean is None else mean) * per_token)
    device = store = uncached = 0
    if num_tokens:   # the last prompt token is always computed
        bs, last = worker.info.block_size, num_tokens - 1
        device = device_blocks * bs if device_blocks * bs < last else last
        cached = (device_blocks if device_blocks > store_blocks else store_blocks) * bs
        cached = cached if cached < last else last
        store, uncached = cached - device, num_tokens - cached
    lc = worker.load_cost
    return PrefillEstimate(worker.info.worker_id, device, store, uncached, queue,
                           overhead + uncached * per_token,
                           lc.overhead_s + store * lc.per_token_s if store else 0.0)
