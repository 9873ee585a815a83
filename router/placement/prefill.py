"""The prefill choice: which worker computes a prompt, and whether ``auto`` mode keeps it local.

``kv-aware`` picks the lowest estimated time to first token (``router.placement.cost``: queue
+ prefill of the uncached tokens + store load of the store-hit ones, device hits from the
:class:`~router.workers.kv_index.KvIndex`, store hits counted by the caller); estimates within
``NEAR_S`` or ``NEAR_REL`` of the lowest count as equal, and of those the worker holding the
most of the prompt in its device cache wins, then the least loaded, and workers still equal
take turns (the estimates rest on costs learned from noisy timings: a difference below their
noise must neither move a prompt off the worker that holds it, duplicating its blocks in
another cache, nor send every prompt to one of two idle workers, leaving the other unused and
its costs unlearned, as a worker back from a restart was). A worker's costs are learned only
from the prompts it is sent, so one priced past the slack (a stalled sample: a restarted
worker's cold first prompts) would never be sent another and never be measured again; so an
idle candidate holding as much of the prompt as the choice, passed over ``PROBE_AFTER`` times
running, is sent the prompt instead (a probe: its costs are measured again);
``least-loaded`` picks the fewest queued+running requests, ties broken on the estimate, then
the worker id; ``round-robin`` rotates. A failed prefill's retry goes to the other
prefill worker with the least queued prefill (:func:`choose_retry`). ``auto`` mode prefills
on the decode worker itself when the part it would compute is short (:func:`prefer_local`).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import Literal

from router.placement.cost import PrefillEstimate, estimate_prefill
from router.workers.kv_index import KvIndex
from router.workers.load import WorkerLoad
from router.workers.pool import WorkerHandle

__all__ = ["PrefillPolicyName", "PREFILL_POLICIES", "PrefillPolicy", "choose_retry", "prefer_local"]

PrefillPolicyName = Literal["kv-aware", "least-loaded", "round-robin"]
PREFILL_POLICIES: tuple[PrefillPolicyName, ...] = ("kv-aware", "least-loaded", "round-robin")
NEAR_S = 0.02     # kv-aware: estimates within 20 ms of the lowest ...
NEAR_REL = 0.1    # ... or within 10% of it are equal; then the most device hits, the least
                  # load, and turns
PROBE_AFTER = 16  # kv-aware: an idle worker passed over this many times running gets a prompt


class PrefillPolicy:
    """Chooses the prefill worker for a prompt (see the module docstring)."""

    def __init__(self, name: PrefillPolicyName, index: KvIndex) -> None:
        if name not in PREFILL_POLICIES:
            raise ValueError(f"unknown prefill policy {name!r}; choose one of {PREFILL_POLICIES}")
        self.name = name
        self._index = index
        self._counter = itertools.count()

    def choose(
        self, candidates: Sequence[WorkerLoad], keys: Sequence[bytes], num_tokens: int,
        store_blocks: int = 0,
    ) -> tuple[WorkerLoad, PrefillEstimate] | None:
        """The chosen worker and its estimate; None when there is no candidate. One candidate
        is the choice whatever the policy (the rotation does not move): the estimate of a
        given worker is ``choose([worker], ...)``."""
        if not candidates:
            return None
        ids = [w.info.worker_id for w in candidates]
        depths = self._index.match(keys, ids)
        if len(candidates) == 1 or self.name == "round-robin":
            w = candidates[0] if len(candidates) == 1 else \
                sorted(candidates, key=lambda w: w.worker_id)[next(self._counter) % len(candidates)]
            return w, estimate_prefill(w, num_tokens, depths[w.worker_id], store_blocks)
        ests = [estimate_prefill(w, num_tokens, depths[wid], store_blocks)
                for w, wid in zip(candidates, ids)]
        ttfts = [e.ttft_s for e in ests]
        if self.name == "kv-aware":
            low = min(ttfts)
            near = low + max(NEAR_S, NEAR_REL * low)
            # equal estimates: the most device hits, the least loaded, then turns
            best = min((-depths[ids[i]], candidates[i].load) for i, t in enumerate(ttfts) if t <= near)
            tied = sorted((i for i, t in enumerate(ttfts)
                           if t <= near and (-depths[ids[i]], candidates[i].load) == best), key=lambda i: ids[i])
            i = tied[next(self._counter) % len(tied)] if len(tied) > 1 else tied[0]
            i = self._probe(candidates, ids, depths, i)
        else:
            i = min(range(len(candidates)), key=lambda i: (candidates[i].load, ttfts[i], ids[i]))
        return candidates[i], ests[i]

    @staticmethod
    def _probe(candidates: Sequence[WorkerLoad], ids: Sequence[str], depths: dict[str, int], i: int) -> int:
        """The kv-aware choice ``i``, or a probe instead: of the idle candidates (no load)
        holding as much of the prompt in their device caches as ``i``, the one passed over most
        often running (``WorkerLoad.passed_over``), once that is ``PROBE_AFTER`` times. The
        count: one more each time a worker is such a candidate and not chosen; unchanged when
        the choice holds more of the prompt; back to 0 when it is chosen or busy."""
        due = max((j for j, w in enumerate(candidates) if j != i and w.load == 0
                   and depths[ids[j]] >= depths[ids[i]]),
                  key=lambda j: candidates[j].passed_over, default=None)
        if due is not None and candidates[due].passed_over >= PROBE_AFTER:
            i = due
        for j, w in enumerate(candidates):
            if j == i or w.load:
                w.passed_over = 0
            elif depths[ids[j]] >= depths[ids[i]]:
                w.passed_over += 1
        return i


def choose_retry(candidates: Sequence[WorkerHandle], failed: Collection[str]) -> WorkerHandle | None:
    """A failed prefill's next worker: of those that have not failed it, the one with the
    least queued prefill (then the least loaded); None when none is left."""
    options = [w for w in candidates if w.worker_id not in failed]
    if not options:
        return None
    return min(options, key=lambda w: (w.load.pending_prefill_tokens, w.load.load, w.worker_id))


def prefer_local(estimate: PrefillEstimate, threshold_tokens: int) -> bool:
    """``auto`` mode: prefill on the decode worker itself when the part it would compute is
    short (below ``threshold_tokens``); a transfer through the store would cost more."""
    return estimate.uncached_tokens < threshold_tokens
