"""Scheduler: continuous batching with chunked prefill, prefix caching and preemption.

One step's plan (:meth:`Scheduler.schedule`), under a token budget of
``max_num_batched_tokens``:

1. Running requests, decodes first (one token each), then requests whose prefill is still
   in progress (the next chunk, as much as the budget allows). When a request needs a block
   and none is free, the running request that arrived last (and is not yet in this step) is
   preempted by recomputation: it frees its blocks and rejoins the front of the waiting queue
   (its full blocks stay in the prefix cache, so the recompute often hits them).
2. Waiting requests, first come first served (the head blocks the queue), while the budget,
   ``max_num_seqs`` and free blocks allow and nothing was preempted this step. On admission a
   request takes its device-cache hits, then the connector's external hits (loaded now), and
   its first chunk. With chunked prefill disabled a prompt is admitted only whole. The store
   is asked only once the request fits without its hits, and once while it waits (the answer
   is kept until admission; a preempted request asks again).

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
from engine.core.connector_api import EngineConnector
from engine.core.config import EngineConfig
from engine.core.sampling import SamplerOutput
from engine.core.request import Request, RequestStatus

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
        self._by_id: dict[str, Request] = {}
        # Waiting requests' store answers: request id -> (device hit tokens, store hit tokens).
        self._store_hits: dict[str, tuple[int, int]] = {}
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------

    def add(self, req: Request) -> None:
        if req.request_id in self._by_id:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        self._by_id[req.request_id] = req
        self.waiting.append(req)

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
        else:
            self.running.remove(req)
        self._finish(req, "abort")
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
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
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                chunk = self._admit(self.waiting[0], budget)
                if chunk is None:
                    break
                out.chunks.append(chunk)
                budget -= chunk.num_tokens
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

    def _admit(self, req: Request, budget: int) -> ScheduledChunk | None:
        """Take ``req``'s hits, load external ones, allocate its first chunk; None if no fit."""
        bm, bs = self.block_manager, self.block_size
        max_hit_blocks = (req.num_tokens - 1) // bs
        hits = bm.lookup(req.block_keys, max_hit_blocks)
        num_device = len(hits) * bs
        # Store hits only ever add blocks (a chunk covers up to hits + budget tokens), so a
        # request that does not fit without them does not fit with them: ask the store only
        # once the blocks for the first chunk without hits are free.
        least = min(req.num_tokens, num_device + budget)
        if not bm.can_allocate(bm.num_blocks_needed(least, len(hits)), hits):
            return None
        num_external = self._external_hits(req, num_device, max_hit_blocks * bs - num_device)
        num_new = req.num_tokens - num_device - num_external
        if num_new > budget:
            # Unchunked, a prompt waits for a step it fits whole; a preempted request's
            # recompute (prompt + outputs) may exceed the budget and is chunked regardless.
            if not self.config.enable_chunked_prefill and req.stats.num_preemptions == 0:
                return None
            num_new = budget
        need = bm.num_blocks_needed(num_device + num_external + num_new, len(hits))
        blocks = bm.allocate(need, hits)
        if blocks is None:
            return None

        self.waiting.popleft()
        self._store_hits.pop(req.request_id, None)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.block_table = blocks
        req.num_computed_tokens = num_device
        req.stats.device_hit_tokens += num_device
        if req.stats.first_scheduled_time is None:
            req.stats.first_scheduled_time = time.perf_counter()
        if self.connector is not None:
            self._offer(req, len(hits))  # the store may have lost blocks we still hold
            if num_external:
                start = len(hits)
                ext_ids = blocks[start : start + num_external // bs]
                loaded = max(0, min(int(self.connector.load(req, ext_ids)), len(ext_ids)))
                bm.cache(ext_ids[:loaded], req.block_keys[start : start + loaded])
                req.num_computed_tokens += loaded * bs
                req.stats.external_hit_tokens += loaded * bs
                req.num_offered_blocks = max(req.num_offered_blocks, start + loaded)
        # A short load leaves more to compute than planned: stay within budget and blocks.
        num_new = min(
            req.num_tokens - req.num_computed_tokens,
            budget,
            len(blocks) * bs - req.num_computed_tokens,
        )
        return ScheduledChunk(req, req.num_computed_tokens, num_new)

    def _external_hits(self, req: Request, num_device: int, most: int) -> int:
        """The connector's hit tokens after ``num_device`` device hits, at most ``most``.

        Asked once while ``req`` waits for room: the answer is kept until ``req`` is admitted,
        and asked again when its device hits changed meanwhile or after a preemption. A block
        the store lost since is a short load, recomputed like any miss.
        """
        if self.connector is None:
            return 0
        known = self._store_hits.get(req.request_id)
        if known is not None and known[0] == num_device:
            hits = known[1]
        else:
            hits = int(self.connector.get_num_external_hits(req, num_device))
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

    def _offer(self, req: Request, num_full_blocks: int) -> None:
        """Offer ``req``'s full blocks not yet offered (nor loaded) to the connector."""
        start = req.num_offered_blocks
        if num_full_blocks > start:
            assert self.connector is not None
            self.connector.save(
                req, req.block_table[start:num_full_blocks], req.block_keys[start:num_full_blocks]
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
