"""The scheduler side: how much of a prompt the store holds, and what each step loads and saves.

It runs in vLLM's scheduler (duck-typed on vLLM's ``Request`` and ``SchedulerOutput``, so this
module imports no vLLM) and owns per-request state: the prompt's block keys (computed once),
its block ids as the scheduler hands them out, how far its blocks are saved.

- ``matched(request, num_computed_tokens)``: tokens past the device hits whose blocks the
  store holds, asked of the store (its longest stored prefix), never the prompt's last token
  (vLLM computes it to sample). Loaded asynchronously: the request waits for its KV while the
  others keep running. A decode given a prefill's ``kv_transfer_params`` (``{"kvstore":
  {"blocks": n}}``) takes those blocks as matched without asking and its load waits for them
  (up to ``handoff_wait_s``): it never recomputes a prefix because it looked too early. A
  request asked about again after its load without a preemption in between had a load fail
  (a block lost or corrupt): it matches nothing more and computes, so a bad block can never
  make vLLM reschedule it forever.
- ``allocated(request, block_ids, num_external_tokens)``: the load's target blocks.
- ``build(scheduler_output)``: this step's ``LoadSpec``s and ``SaveSpec``s; a save covers the
  prompt's full blocks that this step completes (chunked prefill saves chunk by chunk) and
  that were not store hits, and the device hits the store no longer holds (it evicted them
  or restarted since: a decode waits for every block its prefill hands on).
- ``finished(request)``: whether vLLM must hold the request's blocks until the worker reports
  its transfers done (any load or save issued for it: an abort during a load included), and
  the ``kv_transfer_params`` a producer returns for its decode.

A store that cannot be reached matches nothing; nothing here raises into vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvstore.integrations.store_link import StoreLink
from kvstore.integrations.vllm.specs import LoadSpec, SaveSpec, for_rank, request_namespace
from kvstore.keys import BlockKey, block_keys

__all__ = ["SchedulerSide", "SchedulerStats"]

log = logging.getLogger(__name__)

PARAMS_KEY = "kvstore"


@dataclass
class _Req:
    keys: list[BlockKey]
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    saved: int = -1                 # blocks before this index are stored or were hits
    load: tuple[int, int] = (0, 0)  # (first block, count) matched by the last lookup
    wait_s: float = 0.0
    transfers: bool = False         # a load or save was issued: blocks held until reported
    loaded_at: int | None = None    # the request's preemption count when its load was issued


@dataclass
class SchedulerStats:
    lookups: int = 0
    hit_blocks: int = 0
    handoff_blocks: int = 0
    lookup_errors: int = 0


class SchedulerSide:
    def __init__(self, link: StoreLink, namespace: bytes, block_size: int, *, load: bool,
                 save: bool, handoff_wait_s: float, tp_size: int = 1) -> None:
        self.link, self.namespace, self.block_size = link, namespace, block_size
        self.load, self.save = load, save
        self.handoff_wait_s, self.tp_size = handoff_wait_s, tp_size
        self.stats = SchedulerStats()
        self._reqs: dict[str, _Req] = {}
        self._loads: list[LoadSpec] = []

    def _req(self, request: Any) -> _Req:
        r = self._reqs.get(request.request_id)
        if r is None:
            prompt = list(request.prompt_token_ids or [])
            ns = request_namespace(self.namespace, getattr(request, "cache_salt", None),
                                   getattr(request, "lora_request", None))
            r = self._reqs[request.request_id] = _Req(block_keys(ns, prompt, self.block_size), len(prompt))
        return r

    # --- vLLM's scheduler calls ----------------------------------------------------------------

    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.load:
            return 0, False
        r = self._req(request)
        usable = (r.prompt_len - 1) // self.block_size  # the last token is always computed
        start = num_computed_tokens // self.block_size
        if start >= usable:
            return 0, False
        preemptions = int(getattr(request, "num_preemptions", 0) or 0)
        if r.loaded_at == preemptions:
            # Asked again without a preemption since its load: the load failed (vLLM reschedules
            # the request from its first bad block). Computing is the way on: a second load of
            # the same blocks would fail the same way, again and again.
            return 0, False
        handed = _handoff_blocks(getattr(request, "kv_transfer_params", None))
        if handed is not None and r.loaded_at is None:
            n, r.wait_s = max(0, min(handed, usable) - start), self.handoff_wait_s
            self.stats.handoff_blocks += n
        else:
            n, r.wait_s = self._lookup(r.keys[start:usable]), 0.0
        r.load = (start, n)
        return n * self.block_size, n > 0

    def _lookup(self, keys: list[BlockKey]) -> int:
        client = self.link.get()
        if client is None:
            return 0
        try:
            n = int(client.prefix_len(for_rank(keys, 0, self.tp_size)))
        except Exception as exc:  # noqa: BLE001 - a store error, or anything else: a miss, never raised into vLLM
            log.warning("kvstore: lookup failed, a miss: %s", exc)
            self.link.reset()
            self.stats.lookup_errors += 1
            return 0
        self.stats.lookups += 1
        self.stats.hit_blocks += n
        return n

    def allocated(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        r = self._req(request)
        r.block_ids = list(block_ids)
        if num_external_tokens <= 0:
            return
        start, n = r.load
        n = min(n, num_external_tokens // self.block_size)
        end = start + n
        if n <= 0 or len(block_ids) < end:
            return
        self._loads.append(LoadSpec(request.request_id, tuple(r.keys[start:end]),
                                    tuple(block_ids[start:end]), r.wait_s))
        r.saved = max(r.saved, end)
        r.transfers = True
        r.loaded_at = int(getattr(request, "num_preemptions", 0) or 0)

    def build(self, out: Any) -> tuple[list[LoadSpec], list[SaveSpec]]:
        loads, self._loads = self._loads, []
        saves: list[SaveSpec] = []
        if not self.save:
            return loads, saves
        for new in out.scheduled_new_reqs:
            r = self._reqs.get(new.req_id)
            if r is None:
                continue
            r.block_ids = list(new.block_ids[0])
            hits = new.num_computed_tokens // self.block_size
            if r.saved < hits:  # device hits: saved only where the store lost them
                self._save_missing(new.req_id, r, hits, saves)
                r.saved = hits
            self._save(new.req_id, r, new.num_computed_tokens + out.num_scheduled_tokens[new.req_id], saves)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            r = self._reqs.get(req_id)
            if r is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    r.block_ids = list(new_ids[0])
                else:
                    r.block_ids.extend(new_ids[0])
            if r.saved < 0:
                r.saved = cached.num_computed_tokens[i] // self.block_size
            self._save(req_id, r, cached.num_computed_tokens[i] + out.num_scheduled_tokens[req_id], saves)
        return loads, saves

    def _save_missing(self, req_id: str, r: _Req, upto: int, saves: list[SaveSpec]) -> None:
        """Queue the request's first ``upto`` blocks (vLLM's device hits) that the store does
        not hold: it may have evicted them, or restarted, since this instance saved them, and a
        producer's decode waits for every block it hands on."""
        client = self.link.get()
        if client is None or upto <= 0:
            return
        try:
            held = client.contains(for_rank(r.keys[:upto], 0, self.tp_size))
        except Exception as exc:  # noqa: BLE001 - a miss: nothing saved, nothing raised into vLLM
            log.warning("kvstore: lookup failed, device hits not checked: %s", exc)
            self.link.reset()
            return
        missing = [i for i in range(min(upto, len(r.block_ids))) if not held[i]]
        if missing:
            saves.append(SaveSpec(req_id, tuple(r.keys[i] for i in missing),
                                  tuple(r.block_ids[i] for i in missing)))
            r.transfers = True

    def _save(self, req_id: str, r: _Req, computed: int, saves: list[SaveSpec]) -> None:
        """Queue the prompt's full blocks that ``computed`` tokens complete."""
        full = min(computed, r.prompt_len) // self.block_size
        full = min(full, len(r.block_ids), len(r.keys))
        if full > r.saved:
            saves.append(SaveSpec(req_id, tuple(r.keys[r.saved:full]), tuple(r.block_ids[r.saved:full])))
            r.saved = full
            r.transfers = True

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        r = self._reqs.pop(request.request_id, None)
        if r is None:
            return False, None
        params = {PARAMS_KEY: {"blocks": r.prompt_len // self.block_size}} if self.save else None
        return r.transfers, params


def _handoff_blocks(params: Any) -> int | None:
    """The block count a prefill handed over in ``kv_transfer_params``, or None."""
    if not isinstance(params, dict):
        return None
    ours = params.get(PARAMS_KEY)
    if not isinstance(ours, dict):
        return None
    blocks = ours.get("blocks")
    return blocks if isinstance(blocks, int) and blocks >= 0 else None
