"""Request: one request's state inside the engine (vLLM V1's name for it).

A request carries its token ids (prompt, then outputs), its sampling parameters, its block
table in the paged KV cache, how many of its tokens are in that cache (``num_computed_tokens``),
and its kvstore :class:`BlockKey` s. Keys are computed incrementally as tokens arrive (one
``xxh3_128`` per block that fills, chained from the previous key) and never recomputed: the
block manager, the connector and the store only read them.

Tokens a request arrives with (its prompt, plus any ``output_token_ids`` produced elsewhere:
a prefill->decode handoff or a resume) are its *initial* tokens; the engine computes them like
a prompt and generates from position ``num_initial_tokens``. Given output tokens count against
``max_tokens``.

Only the scheduler mutates a request (statuses, block table, computed tokens, appended
tokens); everything else reads it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from engine.api.generate import FinishReason, SamplingParams, TokenLogprob
from kvstore.keys import BlockKey, block_keys, extend_block_keys

__all__ = ["RequestStatus", "RequestKV", "LoadTally", "RequestProgress", "Request"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"   # its blocks are allocated; the store is loading them
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestKV:
    """What the KV connector does for one request, carried on it (vLLM carries its
    ``kv_transfer_params`` the same way): written by the worker when the request arrives and
    by the scheduler as its loads end; read by the connector.

    - ``save``: put its new full blocks to the store even when the connector does not save
      every request (a prefill for a decode elsewhere); ``handoff``: to this host's store node.
    - ``source``: the store node its prefill handed its blocks to (loaded from there first).
    - ``load``: its loads so far, summed over admissions (a preempted request loads again).
    - ``store_failed``: a load of it timed out: it computes from now on, never asks again.
    """

    save: bool = False
    handoff: bool = False
    source: str | None = None
    load: LoadTally = field(default_factory=lambda: LoadTally())
    store_failed: bool = False


@dataclass
class LoadTally:
    """Store loads of one request: ``loaded`` leading blocks verified in the cache of the
    ``requested``; ``missing``/``corrupt`` ended a run; ``bytes`` and busy ``seconds``."""

    loaded: int = 0
    requested: int = 0
    missing: int = 0
    corrupt: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, other: LoadTally) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class RequestProgress:
    """Counters and timeline of one request (``time.perf_counter`` seconds).

    Token counters sum over admissions (a preempted request is admitted again):
    ``computed_prompt_tokens`` are initial tokens this engine computed, ``device_hit_tokens``
    came from its own prefix cache, ``store_hit_tokens`` were loaded from the store. These and
    the spans (``queue_s``, ``prefill_s``, ``first_token_s``) have the names of the worker's
    report, ``engine.api.generate.RequestStats``, which the worker builds from them.
    """

    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    computed_prompt_tokens: int = 0
    device_hit_tokens: int = 0
    store_hit_tokens: int = 0
    num_preemptions: int = 0

    @property
    def queue_s(self) -> float:
        return _span(self.arrival_time, self.first_scheduled_time)

    @property
    def prefill_s(self) -> float:
        return _span(self.first_scheduled_time, self.first_token_time)

    @property
    def first_token_s(self) -> float:
        return _span(self.arrival_time, self.first_token_time)


def _span(start: float | None, end: float | None) -> float:
    return 0.0 if start is None or end is None else max(0.0, end - start)


class Request:
    """One request. ``namespace`` is the (already salted) namespace its keys hash under."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        namespace: BlockKey,
        block_size: int,
        output_token_ids: Sequence[int] = (),
        arrival_time: float | None = None,
        prefix_keys: Sequence[BlockKey] = (),
    ) -> None:
        """``prefix_keys``: keys of the first full blocks of the tokens, when the caller has
        them already (hashed under the same namespace); only the blocks after them are hashed."""
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.namespace = namespace
        self.block_size = block_size
        self.token_ids: list[int] = [*prompt_token_ids, *output_token_ids]
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_initial_tokens = len(self.token_ids)
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        # Blocks with index < this were offered to the connector for saving or came from it.
        self.num_offered_blocks = 0
        self.output_logprobs: list[TokenLogprob] = []
        self.block_keys: list[BlockKey] = (
            extend_block_keys(namespace, prefix_keys, self.token_ids, block_size) if prefix_keys
            else block_keys(namespace, self.token_ids, block_size))
        self.stats = RequestProgress()
        self.kv = RequestKV()
        if arrival_time is not None:
            self.stats.arrival_time = arrival_time

    # -- reads ----------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True while more than one token is uncomputed (a prompt or a recompute)."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def prompt_block_keys(self) -> list[BlockKey]:
        """Keys of the prompt's full blocks (what a prefill hands over)."""
        return self.block_keys[: self.num_prompt_tokens // self.block_size]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    # -- writes (scheduler only) ----------------------------------------------------------

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        """Append a sampled token; hash the block it completes, if it completes one."""
        self.token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        n = len(self.token_ids)
        if n % self.block_size == 0:
            # key[i] = xxh3_128(key[i-1] || block i): extend from the last key over one block.
            parent = self.block_keys[-1] if self.block_keys else self.namespace
            self.block_keys.extend(
                extend_block_keys(parent, [], self.token_ids[n - self.block_size :], self.block_size)
            )
