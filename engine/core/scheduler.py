"""Scheduler: continuous batching with chunked prefill, prefix caching and preemption.

One step's plan (:meth:`Scheduler.schedule`), under a token budget of
``max_num_batched_tokens``:

1. Running requests, decodes first (one token each), then requests whose prefill is still
   in progress (the next chunk, as much as the budget allows). When a request needs a block
   and none is free, the running request that arrived last (and is not yet in this step) is
   preempted by recomputation: it frees its blocks and rejoins the front of the waiting queue
   (its full blocks stay in the prefix cache, so the recompute often hits them).
2. Waiting requests, first come first served (the head blocks the queue when it does not fit),
   while the budget, ``max_num_seqs`` and free blocks allow and nothing was preempted this
   step. On admission a request takes its device-cache hits, then the connector's store hits:
   with store hits it is parked (``WAITING_FOR_KV``, its blocks allocated, none computed this
   step) while the connector loads them off the engine thread, and the running batch keeps
   stepping. A request whose store answer is not in yet, or whose next block another
   request's load is bringing in, is passed over until a later step (the ones behind it may
   go first); the second then finds those blocks in the device cache. The store is asked
   only once the request fits without its hits, and once while it waits (the answer is kept
   until admission; a preempted request asks again).
3. Every step begins with the loads that ended: their verified leading blocks are cached and
   count as computed, and the request joins the running batch (a short load leaves the rest
   to compute). A load past ``EngineConfig.kv_load_timeout_s`` is abandoned: the request goes
   back to the front of the waiting queue and computes everything (it never asks the store
   again); an aborted request's load likewise. Their target blocks stay allocated until the
   load reports, so the loader never writes a block that another request holds.

At least the last initial token of a request is always computed (hits are capped at
``(num_tokens - 1) // block_size`` blocks), so every prefill ends with logits to sample.

After the model ran, :meth:`Scheduler.postprocess` advances ``num_computed_tokens``, caches the
blocks that became full, offers them to the connector, appends sampled tokens, and finishes
requests (stop token, ``max_tokens``, context window). Only the scheduler mutates requests
and blocks. Not thread-safe: one engine thread drives it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.api.generate import FinishReason
from engine.core.block_manager import BlockManager
from engine.core.config import EngineConfig
from engine.core.connector_api import EngineConnector
from engine.core.request import Request, RequestStatus
from engine.core.sampling import SamplerOutput
from kvstore.keys import BlockKey

__all__ = ["ScheduledChunk", "SchedulerOutput", "Scheduler"]


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``req`` from ``start_pos`` to compute this step."""

    request: Request
    start_pos: int
    num_tokens: int
    # True when the chunk ends at the request's last token: its logits are sampled. Fixed at
    # planning time (postprocess appends the sampled token).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start_pos + self.num_tokens == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids[self.start_pos : self.start_pos + self.num_tokens]


@dataclass
class _Loading:
    """A request parked while the connector loads ``block_ids`` (under ``keys``)."""

    request: Request
    block_ids: list[int]
    keys: list[BlockKey]
    deadline: float


class _Pass:
    """An ``_admit`` answer: not now (an I/O answer pending), try the next waiting request."""


class _NoRoom:
    """An ``_admit`` answer: the request does not fit; nothing behind it is admitted."""


_PASS, _NO_ROOM = _Pass(), _NoRoom()


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def sampled_chunks(self) -> list[ScheduledChunk]:
        return [c for c in self.chunks if c.samples]


class Scheduler:
    """Waiting and running queues over one :class:`BlockManager`. See the module docstring."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        *,
        max_model_len: int,
        eos_token_ids: Sequence[int] = (),
        connector: EngineConnector | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, _Loading] = {}     # parked while the connector loads their KV
        self._loading_keys: set[BlockKey] = set()  # the keys of every load in flight
        # Loads given up (an abort, a deadline): their target blocks, freed when each reports.
        # One loader reports in order, so a request id's first report is its oldest load.
        self._abandoned: dict[str, list[list[int]]] = {}
        self._by_id: dict[str, Request] = {}
        # Waiting requests' store answers: request id -> (device hit tokens, store hit tokens).
        self._store_hits: dict[str, tuple[int, int]] = {}
        self.num_preemptions = 0
        self.num_abandoned_loads = 0
        # Requests the last step waited on I/O for (passed over for an answer, or loading).
        self.io_waits = 0

    # -- queue management -------------------------------------------------------------------

    def add(self, req: Request) -> None:
        if req.request_id in self._by_id:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        self._by_id[req.request_id] = req
        self.waiting.append(req)
        if self.connector is not None and not req.kv.store_failed:
            self.connector.lookup_ahead(req)

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def abort(self, request_id: str) -> Request | None:
        """Finish ``request_id`` with reason ``"abort"`` and free its blocks (None if unknown)."""
        req = self._by_id.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
            self._store_hits.pop(req.request_id, None)
        elif req.status is RequestStatus.WAITING_FOR_KV:
            self._abandon(self.loading[request_id])
        else:
            self.running.remove(req)
        self._finish(req, "abort")
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    @property
    def blocks_held_by_abandoned_loads(self) -> int:
        return sum(len(ids) for loads in self._abandoned.values() for ids in loads)

    # -- planning ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._collect_loads()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        decodes = [s for s in self.running if not s.is_prefill]
        prefills = [s for s in self.running if s.is_prefill]
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._reserve(req, num_new, scheduled, out.preempted):
                continue
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, num_new))
            scheduled.add(req.request_id)
            budget -= num_new
        passed: list[Request] = []
        if not out.preempted:
            while (self.waiting and budget > 0
                   and len(self.running) + len(self.loading) < self.config.max_num_seqs):
                got = self._admit(self.waiting[0], budget)
                if got is _NO_ROOM:
                    break
                if got is _PASS:
                    passed.append(self.waiting.popleft())
                elif isinstance(got, ScheduledChunk):
                    out.chunks.append(got)
                    budget -= got.num_tokens
            self.waiting.extendleft(reversed(passed))
        self.io_waits = len(passed) + len(self.loading)
        return out

    def _reserve(
        self, req: Request, num_new: int, scheduled: set[str], preempted: list[Request]
    ) -> bool:
        """Blocks for ``num_new`` more tokens of running ``req``, preempting if needed."""
        bm = self.block_manager
        need = bm.num_blocks_needed(req.num_computed_tokens + num_new, len(req.block_table))
        if need == 0:   # most decode steps: the token fits the last block
            return True
        while True:
            blocks = bm.allocate(need)
            if blocks is not None:
                req.block_table.extend(blocks)
                return True
            candidates = [s for s in self.running if s.request_id not in scheduled]
            victim = max(candidates, key=lambda s: s.stats.arrival_time)
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False

    def _admit(self, req: Request, budget: int) -> ScheduledChunk | _Pass | _NoRoom | None:
        """Take ``req``'s hits and allocate its first chunk: the chunk, or None when it was
        parked to load its store hits; ``_PASS`` to ask again later, ``_NO_ROOM`` if no fit."""
        bm, bs = self.block_manager, self.block_size
        max_hit_blocks = (req.num_tokens - 1) // bs
        hits = bm.lookup(req.block_keys, max_hit_blocks)
        num_device = len(hits) * bs
        if len(hits) < max_hit_blocks and req.block_keys[len(hits)] in self._loading_keys:
            return _PASS  # another request's load brings the next blocks in: hit them then
        # Store hits only ever add blocks (a chunk covers up to hits + budget tokens), so a
        # request that does not fit without them does not fit with them: ask the store only
        # once the blocks for the first chunk without hits are free.
        least = min(req.num_tokens, num_device + budget)
        if not bm.can_allocate(bm.num_blocks_needed(least, len(hits)), hits):
            return _NO_ROOM
        num_external = self._external_hits(req, num_device, max_hit_blocks * bs - num_device)
        if num_external is None:
            return _PASS
        num_new = req.num_tokens - num_device - num_external
        if num_new > budget:
            # Unchunked, a prompt waits for a step it fits whole; a preempted request's
            # recompute (prompt + outputs) may exceed the budget and is chunked regardless.
            if not self.config.enable_chunked_prefill and req.stats.num_preemptions == 0:
                return _NO_ROOM
            num_new = budget
        need = bm.num_blocks_needed(num_device + num_external + num_new, len(hits))
        blocks = bm.allocate(need, hits)
        if blocks is None:
            return _NO_ROOM

        self.waiting.popleft()
        self._store_hits.pop(req.request_id, None)
        req.block_table = blocks
        req.num_computed_tokens = num_device
        req.stats.device_hit_tokens += num_device
        if req.stats.first_scheduled_time is None:
            req.stats.first_scheduled_time = time.perf_counter()
        if self.connector is not None:
            self._offer(req, len(hits), held=True)  # the store may have lost blocks we hold
        if num_external:
            assert self.connector is not None
            start = len(hits)
            ids = blocks[start : start + num_external // bs]
            keys = req.block_keys[start : start + len(ids)]
            req.status = RequestStatus.WAITING_FOR_KV
            self.loading[req.request_id] = _Loading(
                req, ids, keys, time.monotonic() + self.config.kv_load_timeout_s)
            self._loading_keys.update(keys)
            self.connector.start_load(req, ids)
            return None
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return ScheduledChunk(req, num_device, num_new)

    def _collect_loads(self) -> None:
        """Take the loads that ended into the batch; give up those past their deadline."""
        if self.connector is None:
            return
        bs = self.block_size
        for done in self.connector.finished_loads():
            rid = done.request_id
            if rid in self._abandoned:
                self.block_manager.free(self._abandoned[rid].pop(0))
                if not self._abandoned[rid]:
                    del self._abandoned[rid]
                continue
            parked = self.loading.pop(rid, None)
            if parked is None:
                continue
            self._loading_keys.difference_update(parked.keys)
            req = parked.request
            req.kv.load.add(done.tally)
            loaded = max(0, min(done.tally.loaded, len(parked.block_ids)))
            start = req.num_computed_tokens // bs
            self.block_manager.cache(parked.block_ids[:loaded], parked.keys[:loaded])
            req.num_computed_tokens += loaded * bs
            req.stats.store_hit_tokens += loaded * bs
            req.num_offered_blocks = max(req.num_offered_blocks, start + loaded)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        now = time.monotonic()
        for parked in [p for p in self.loading.values() if now >= p.deadline]:
            req = parked.request
            self._abandon(parked)
            self.block_manager.free(req.block_table)
            req.block_table = []
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            req.kv.store_failed = True   # the store is too slow for it: compute, never wait again
            self.waiting.appendleft(req)

    def _abandon(self, parked: _Loading) -> None:
        """Give up ``parked``'s load: its target blocks are held until it reports; the
        request keeps its other blocks (the caller frees them)."""
        req = parked.request
        del self.loading[req.request_id]
        self._loading_keys.difference_update(parked.keys)
        self._abandoned.setdefault(req.request_id, []).append(parked.block_ids)
        targets = set(parked.block_ids)
        req.block_table = [b for b in req.block_table if b not in targets]
        self.num_abandoned_loads += 1

    def _external_hits(self, req: Request, num_device: int, most: int) -> int | None:
        """The connector's hit tokens after ``num_device`` device hits, at most ``most``
        (None while the answer is not in).

        Asked once while ``req`` waits for room: the answer is kept until ``req`` is admitted,
        and asked again when its device hits changed meanwhile or after a preemption. A block
        the store lost since is a short load, recomputed like any miss.
        """
        if self.connector is None or req.kv.store_failed or most <= 0:
            return 0   # nothing to ask (the device holds every block the store could give)
        known = self._store_hits.get(req.request_id)
        if known is not None and known[0] == num_device:
            hits = known[1]
        else:
            answer = self.connector.get_num_external_hits(req, num_device)
            if answer is None:
                return None
            hits = int(answer)
            self._store_hits[req.request_id] = (num_device, hits)
        return max(0, min(hits // self.block_size * self.block_size, most))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req.block_table)
        req.block_table = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.stats.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- after the model ran ----------------------------------------------------------------

    def postprocess(self, out: SchedulerOutput, sampled: SamplerOutput) -> list[Request]:
        """Apply one executed step; ``sampled`` rows follow ``out.sampled_chunks``.

        Returns the requests that got a new token, in chunk order (finished ones included).
        """
        bs = self.block_size
        updated: list[Request] = []
        row = 0
        for chunk in out.chunks:
            req = chunk.request
            end = chunk.start_pos + chunk.num_tokens
            req.num_computed_tokens = end
            req.stats.computed_prompt_tokens += max(
                0, min(end, req.num_initial_tokens) - chunk.start_pos
            )
            first, full = chunk.start_pos // bs, end // bs
            if full > first:
                self.block_manager.cache(req.block_table[first:full], req.block_keys[first:full])
            if self.connector is not None:
                self._offer(req, full)
            if not chunk.samples:
                continue
            token = sampled.token_ids[row]
            req.append_token(token, sampled.logprobs[row])
            row += 1
            if req.stats.first_token_time is None:
                req.stats.first_token_time = time.perf_counter()
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason)
            updated.append(req)
        if row != len(sampled.token_ids):
            raise ValueError(f"{len(sampled.token_ids)} sampled rows for {row} sampling chunks")
        return updated

    def _offer(self, req: Request, num_full_blocks: int, held: bool = False) -> None:
        """Offer ``req``'s full blocks not yet offered (nor loaded) to the connector
        (``held``: device hits, which the store usually holds already)."""
        start = req.num_offered_blocks
        if num_full_blocks > start:
            assert self.connector is not None
            self.connector.save(
                req, req.block_table[start:num_full_blocks], req.block_keys[start:num_full_blocks],
                held,
            )
            req.num_offered_blocks = num_full_blocks

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.sampling_params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Mark ``req`` finished and free its blocks; the caller took it off its queue."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stats.finished_time = time.perf_counter()
        del self._by_id[req.request_id]
        if self.connector is not None:
            self.connector.request_finished(req)
        self.block_manager.free(req.block_table)
        req.block_table = []
