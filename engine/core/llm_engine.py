"""LLMEngine: requests in, tokens out; one step = schedule -> execute -> sample -> postprocess.

Usage::

    engine = LLMEngine(model_dir, EngineConfig(num_blocks=256))
    engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=32, temperature=0))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.new_token_ids, out.finished)

Contracts:

- ``add_request`` validates everything a request can get wrong (token ids outside the
  vocabulary, prompt + ``max_tokens`` beyond the context window or the KV cache, a duplicate
  id) and raises :class:`ValueError` naming the problem *before* touching any state, so a bad
  request never disturbs the others.
- ``output_token_ids`` given up front (a handoff or a resume) are context: the engine computes
  them like the prompt, generates from position ``len(prompt) + len(output_token_ids)``, and
  counts them against ``max_tokens``. With the same seed, the tokens sampled from there on are
  those the original run sampled.
- A request without a seed gets a random one at admission; every :class:`RequestOutput`
  reports it.
- ``block_keys`` given with a request (a decode handoff: the prefill worker's keys of the
  prompt's full blocks) must equal this engine's own keys for the prompt, or ``add_request``
  raises :class:`BlockKeyMismatch` (a ``ValueError``) and admits nothing: the two engines
  disagree on the model, the KV layout or the salt, and the other's blocks must not be loaded.
- The engine's namespace id comes from the runner's facts (config, weights digest, dtype,
  block size, layout); a request's keys hash under it, salted by its ``cache_salt``.
- ``on_kv_event`` receives the block manager's ``stored``/``removed`` events, and an optional
  :class:`~engine.core.connector_api.EngineConnector` is called by the scheduler. Single-threaded:
  one thread calls ``add_request``/``abort``/``step``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from engine.api.blocks import blocks_needed
from engine.api.generate import FinishReason, TokenLogprob
from engine.core.block_manager import BlockManager, KVEvent
from engine.core.config import EngineConfig
from engine.core.connector_api import EngineConnector
from engine.core.request import Request, RequestKV, RequestProgress
from engine.core.sampling import SamplerOutput, SamplingParams, sample, with_seed
from engine.core.scheduler import Scheduler, SchedulerOutput
from kvstore.keys import BlockKey, namespace_id, salted

if TYPE_CHECKING:  # the model stack is imported when a runner is built from a directory
    from engine.model.config import ModelConfig
    from engine.model.runner import StepItem

__all__ = ["BlockKeyMismatch", "RequestOutput", "Completion", "Runner", "LLMEngine"]


class BlockKeyMismatch(ValueError):
    """A request's given ``block_keys`` differ from this engine's keys for its prompt."""


class Runner(Protocol):
    """What the engine needs of a model runner (``engine.model.runner.ModelRunner``)."""

    config: ModelConfig  # vocab_size, max_position_embeddings, eos_token_ids
    block_size: int
    num_blocks: int

    def facts(self) -> dict[str, Any]: ...
    def execute(self, items: list[StepItem]) -> torch.Tensor: ...


@dataclass
class RequestOutput:
    """What one step produced for one request: usually one token; the last one says why."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None  # when the request asked for logprobs
    finished: bool
    finish_reason: FinishReason | None  # once finished
    seed: int | None
    stats: RequestProgress
    kv: RequestKV


@dataclass
class Completion:
    """A whole request's result, from :meth:`LLMEngine.generate`."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stats: RequestProgress | None = None


class LLMEngine:
    """The engine core over one runner. See the module docstring."""

    def __init__(
        self,
        runner: Runner | str | Path,
        config: EngineConfig | None = None,
        *,
        connector: EngineConnector | None = None,
        on_kv_event: Callable[[KVEvent], None] | None = None,
    ) -> None:
        config = config or EngineConfig()
        if isinstance(runner, (str, Path)):
            from engine.model.runner import ModelRunner

            runner = ModelRunner(
                runner,
                num_blocks=config.num_blocks,
                block_size=config.block_size,
                dtype=config.dtype,
                device=config.device,
            )
        elif runner.block_size != config.block_size or runner.num_blocks != config.num_blocks:
            raise ValueError(
                f"runner has num_blocks={runner.num_blocks}, block_size={runner.block_size} but "
                f"EngineConfig says {config.num_blocks}, {config.block_size}; make them agree"
            )
        self.runner = runner
        self.model_config = runner.config
        context = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > context:
            raise ValueError(
                f"EngineConfig.max_model_len={config.max_model_len} exceeds the model's "
                f"max_position_embeddings={context}"
            )
        self.config = config
        self.max_model_len = config.max_model_len or context
        self.namespace: BlockKey = namespace_id(runner.facts())
        self.block_manager = BlockManager(
            config.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            on_event=on_kv_event,
        )
        self.scheduler = Scheduler(
            config,
            self.block_manager,
            max_model_len=self.max_model_len,
            eos_token_ids=self.model_config.eos_token_ids,
            connector=connector,
        )
        self._pending: list[RequestOutput] = []
        self._generate_calls = itertools.count()
        self._idle_step = False

    # -- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        output_token_ids: Sequence[int] = (),
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        block_keys: Sequence[BlockKey] | None = None,
        kv: RequestKV | None = None,
    ) -> SamplingParams:
        """Queue a request; returns its parameters with the seed it will sample with.
        ``kv``: what the connector does for it (saved, handed off, loaded from where)."""
        params = params if params is not None else SamplingParams()
        self._validate(request_id, prompt_token_ids, output_token_ids, params)
        req = Request(
            request_id,
            [int(t) for t in prompt_token_ids],
            with_seed(params),
            namespace=salted(self.namespace, cache_salt),
            block_size=self.config.block_size,
            output_token_ids=[int(t) for t in output_token_ids],
            arrival_time=arrival_time,
        )
        if block_keys is not None:
            self._check_keys(req, block_keys, cache_salt)
        if kv is not None:
            req.kv = kv
        self.scheduler.add(req)
        return req.sampling_params

    def prompt_block_keys(self, request_id: str) -> list[BlockKey]:
        """Keys of a live request's full prompt blocks (computed at admission, only read)."""
        req = self.scheduler.get(request_id)
        if req is None:
            raise KeyError(request_id)
        return req.prompt_block_keys

    def abort(self, request_id: str) -> bool:
        """Abort a request and free its blocks; its final output comes from the next step."""
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        self._pending.append(self._output(req, []))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_loading(self) -> int:
        """Requests parked while the connector loads their KV."""
        return len(self.scheduler.loading)

    @property
    def waiting_on_io(self) -> bool:
        """The last step computed nothing and some request waits on the connector's I/O (a
        lookup's answer or a load): nothing to do until :meth:`wait_for_io` returns."""
        return self._idle_step and self.scheduler.io_waits > 0

    def wait_for_io(self, timeout: float) -> None:
        """Sleep until the connector's lookup or load ends (at most ``timeout`` seconds)."""
        connector = self.scheduler.connector
        if connector is not None:
            connector.wait(timeout)

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of every request that produced a token or ended."""
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        self._idle_step = not plan.chunks
        if not plan.chunks:
            return outputs
        logits = self.runner.execute(self._step_items(plan))
        rows = [i for i, c in enumerate(plan.chunks) if c.samples]
        sampled = SamplerOutput([], [])
        if rows:  # partial prefill chunks' logits are dropped
            if len(rows) != len(plan.chunks):
                logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            reqs = [plan.chunks[i].request for i in rows]
            sampled = sample(logits, [s.sampling_params for s in reqs], [s.num_tokens for s in reqs],
                             reqs, self.model_config.eos_token_ids)
        for req in self.scheduler.postprocess(plan, sampled):
            outputs.append(self._output(req, req.token_ids[-1:]))
        return outputs

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run ``prompts`` to completion together (a convenience for tests and scripts)."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        base = f"generate-{next(self._generate_calls)}-"
        results = {f"{base}{i}": Completion(f"{base}{i}") for i in range(len(prompts))}
        for (rid, _), prompt, p in zip(results.items(), prompts, params, strict=True):
            self.add_request(rid, prompt, p)
        while self.has_unfinished():
            if self.waiting_on_io:
                self.wait_for_io(0.1)
            for out in self.step():
                done = results.get(out.request_id)
                if done is None:
                    continue
                done.token_ids.extend(out.new_token_ids)
                done.logprobs.extend(out.new_logprobs or ())
                if out.finished:
                    done.finish_reason, done.stats = out.finish_reason, out.stats
        return list(results.values())

    # -- helpers ------------------------------------------------------------------------------

    def _step_items(self, plan: SchedulerOutput) -> list[StepItem]:
        from engine.model.runner import StepItem

        return [StepItem(c.token_ids, c.start_pos, c.request.block_table) for c in plan.chunks]

    def _output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        logprobs = None
        if req.sampling_params.logprobs is not None:
            logprobs = req.output_logprobs[-1:] if new_tokens else []
        return RequestOutput(
            req.request_id,
            list(new_tokens),
            logprobs,
            req.is_finished,
            req.finish_reason,
            req.sampling_params.seed,
            req.stats,
            req.kv,
        )

    def _check_keys(self, req: Request, given: Sequence[BlockKey], salt: str | None) -> None:
        ours = req.prompt_block_keys
        if list(given) == ours:
            return
        where = (f"{len(given)} keys given, {len(ours)} full prompt blocks here"
                 if len(given) != len(ours) else
                 next(f"block {i} differs (given {a.hex()}, computed {b.hex()})"
                      for i, (a, b) in enumerate(zip(given, ours, strict=True)) if a != b))
        raise BlockKeyMismatch(
            f"request {req.request_id!r}: block_keys do not match this worker's keys for the "
            f"prompt ({where}): the prefill worker and this one disagree on the model, the KV "
            f"layout or the cache salt (this worker's namespace is {self.namespace.hex()}"
            f"{', salted' if salt else ''}); refusing to load its blocks"
        )

    def _validate(
        self,
        request_id: str,
        prompt: Sequence[int],
        given: Sequence[int],
        params: SamplingParams,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if self.scheduler.get(request_id) is not None:
            raise ValueError(f"request {request_id!r}: the id is already in the engine")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens")
        vocab = self.model_config.vocab_size
        for what, ids in (("prompt_token_ids", prompt), ("output_token_ids", given),
                          ("sampling.logit_bias", list(params.logit_bias or ()))):
            _check_token_ids(request_id, what, ids, vocab)
        if len(given) >= params.max_tokens:
            raise ValueError(
                f"request {request_id!r}: {len(given)} output tokens given up front leave nothing "
                f"to generate under max_tokens={params.max_tokens}"
            )
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt ({len(prompt)} tokens) + max_tokens "
                f"({params.max_tokens}) = {total} exceeds the context window of "
                f"{self.max_model_len} tokens"
            )
        blocks = blocks_needed(len(prompt), params.max_tokens, self.config.block_size)
        if blocks > self.config.num_blocks:
            raise ValueError(
                f"request {request_id!r}: {total} tokens need {blocks} KV blocks; the cache has "
                f"{self.config.num_blocks}"
            )
        initial = len(prompt) + len(given)
        if not self.config.enable_chunked_prefill and initial > self.config.max_num_batched_tokens:
            raise ValueError(
                f"request {request_id!r}: {initial} prompt tokens exceed max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens} and chunked prefill is disabled"
            )


def _check_token_ids(request_id: str, what: str, ids: Iterable[int], vocab: int) -> None:
    arr = np.asarray(ids)
    if arr.size == 0:
        return
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"request {request_id!r}: {what} must be a flat list of integers")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"request {request_id!r}: {what} holds token id {bad}, outside the vocabulary "
            f"[0, {vocab})"
        )

