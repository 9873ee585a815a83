"""One simulated engine worker: the engine's own scheduler and block manager on a virtual clock.

A :class:`SimWorker` runs ``engine.core.scheduler.Scheduler`` over an
``engine.core.block_manager.BlockManager`` exactly as ``LLMEngine.step`` does (continuous
batching, chunked prefill, prefix caching, preemption, the store's hits at admission), with
the model replaced by time: each step lasts ``StepCosts.step_s`` of the batch it scheduled,
plus ``load_s`` of every store load the scheduler made at admission (synchronous on the engine
thread, as ``KVStoreConnector.load`` is). Sampled tokens are a constant id (outputs never
extend a prompt's prefix: a real model's greedy reply is not the workload's next turn either).

Saves: every full block a step completes (all of them on a prefill or colocated worker; none
on a decode worker, as ``kvengine serve --role decode`` does not save by default) goes to the
worker's saver, one FIFO thread: a batch of ``n`` blocks takes ``save_s(n)`` after the one
before it, and its keys enter the store when it completes. A prefill phase's first token is
held until its last save completed (the handoff: ``engine.worker.worker``), and any phase's
final line waits for its saves.

What the router sees of the worker: its ``WorkerLoad`` (the router's own books, fed load
figures at most every ``load_interval_s`` and each finished phase's stats, as the worker
client does) and its device cache in the router's ``KvIndex`` (block events applied at once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from engine.api.events import BlockEvent, LoadFigures, Snapshot
from engine.api.generate import RequestStats, SamplingParams, WorkerInfo, WorkerRole
from engine.core.block_manager import BlockManager, KVEvent
from engine.core.config import EngineConfig
from engine.core.connector_api import LoadDone
from engine.core.request import LoadTally, Request
from engine.core.sampling import SamplerOutput
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.worker.events import RateMeter
from kvstore.keys import BlockKey
from planner.sim.costs import StepCosts
from planner.sim.store import SimStore
from router.workers.kv_index import KvIndex
from router.workers.load import WorkerLoad
from router.workers.pool import WorkerHandle

__all__ = ["WorkerSpec", "SimWorker", "Phase"]

OUTPUT_TOKEN = 0
Phase = str  # "prefill" | "decode" | "full"


@dataclass(frozen=True)
class WorkerSpec:
    """One worker's engine settings (``kvengine serve``'s flags)."""

    role: WorkerRole = "colocated"
    num_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int = 2048
    threads: int = 1
    save_all: bool | None = None  # None: every role but decode saves

    @property
    def saves(self) -> bool:
        return self.save_all if self.save_all is not None else self.role != "decode"


@dataclass(eq=False)
class PhaseState:
    """One phase of one choice on this worker."""

    choice: Any                   # the simulation's choice object (opaque here)
    phase: Phase
    request: Request
    books: Any                    # router.workers.load.Assignment
    admitted_at: float | None = None
    first_token_at: float | None = None
    saves_done_at: float = 0.0
    load_s: float = 0.0


class _Connector:
    """The store as the scheduler sees it (``engine.core.connector_api.EngineConnector``):
    lookups answer at once; a load runs on the worker's one loader (queued behind the one
    before it) while the worker keeps stepping, and ends at the step after it is done."""

    def __init__(self, worker: SimWorker) -> None:
        self.w = worker
        self._done: list[LoadDone] = []
        self._free_at = 0.0

    def lookup_ahead(self, req: Request) -> None:
        pass

    def get_num_external_hits(self, req: Request, num_device_hit_tokens: int) -> int:
        bs = self.w.spec.block_size
        return self.w.store.prefix_len(req.block_keys[num_device_hit_tokens // bs:]) * bs

    def start_load(self, req: Request, block_ids: Sequence[int]) -> None:
        w = self.w
        start = req.num_computed_tokens // w.spec.block_size
        n = w.store.prefix_len(req.block_keys[start:start + len(block_ids)])
        seconds = w.costs.load_s(n)
        done_at = max(w.now, self._free_at) + seconds
        self._free_at = done_at
        st = w.phases.get(req.request_id)
        if st is not None:
            st.load_s += seconds
        tally = LoadTally(n, len(block_ids), seconds=seconds)

        def done() -> None:
            self._done.append(LoadDone(req.request_id, tally))
            w.load_rate.update(n * w.spec.block_size, seconds)
            w.wake(done_at)

        w.schedule(done_at, done)

    def finished_loads(self) -> list[LoadDone]:
        out, self._done = self._done, []
        return out

    def wait(self, timeout: float) -> None:
        pass

    def save(self, req: Request, block_ids: Sequence[int], keys: Sequence[BlockKey],
             held: bool = False) -> None:
        w = self.w
        st = w.phases.get(req.request_id)
        if not (w.spec.saves or (st is not None and st.phase == "prefill")) or not keys:
            return
        start = max(w.now, w.saver_free_at)
        done = start + w.costs.save_s(len(keys))
        w.saver_free_at = done
        w.schedule(done, lambda keys=list(keys): w.store.put(keys))
        if st is not None:
            st.saves_done_at = done

    def request_finished(self, req: Request) -> None:
        pass


class SimWorker:
    """See the module docstring. ``schedule(t, fn)`` is the simulation's event queue;
    ``on_tokens(state, t)`` and ``on_finished(state, t)`` its callbacks."""

    def __init__(self, worker_id: str, spec: WorkerSpec, costs: StepCosts, store: SimStore,
                 index: KvIndex, namespace: BlockKey, *,
                 schedule: Callable[[float, Callable[[], None]], None],
                 on_tokens: Callable[[PhaseState, float], None],
                 on_finished: Callable[[PhaseState, float], None],
                 load_interval_s: float = 0.5) -> None:
        self.worker_id, self.spec, self.costs, self.store = worker_id, spec, costs, store
        self.index, self.namespace = index, namespace
        self.schedule, self._on_tokens, self._on_finished = schedule, on_tokens, on_finished
        self.load_interval_s = load_interval_s
        self.info = WorkerInfo(worker_id, f"sim://{worker_id}", spec.role, "sim", namespace,
                               spec.block_size, spec.num_blocks, spec.max_model_len)
        self.load = WorkerLoad(self.info)
        self.handle = WorkerHandle(self.info, cast(Any, None), self.load, cast(Any, None))
        self._seq = 0
        index.reset(worker_id, Snapshot(0, (), LoadFigures()))
        self.blocks = BlockManager(spec.num_blocks, spec.block_size, on_event=self._event)
        cfg = EngineConfig(num_blocks=spec.num_blocks, block_size=spec.block_size,
                           max_num_seqs=spec.max_num_seqs,
                           max_num_batched_tokens=spec.max_num_batched_tokens,
                           enable_chunked_prefill=spec.enable_chunked_prefill,
                           max_model_len=spec.max_model_len)
        self.scheduler = Scheduler(cfg, self.blocks, max_model_len=spec.max_model_len,
                                   connector=_Connector(self))
        self.phases: dict[str, PhaseState] = {}
        self.now = 0.0
        self.busy = False
        self.saver_free_at = 0.0
        self.busy_s = 0.0
        self.steps = 0
        self.prefill_rate, self.decode_rate, self.load_rate = RateMeter(), RateMeter(), RateMeter()
        self._last_publish = -1e9

    # --- the router's view ---------------------------------------------------------------
    def _event(self, ev: KVEvent) -> None:
        self._seq += 1
        self.index.apply(self.worker_id, BlockEvent(self._seq, ev.type, ev.keys))

    def _publish(self, t: float, force: bool = False) -> None:
        if not force and t - self._last_publish < self.load_interval_s:
            return
        self._last_publish = t
        s = self.scheduler
        self.load.observe_load(LoadFigures(
            waiting=len(s.waiting), running=len(s.running) + len(s.loading),
            kv_free_blocks=self.blocks.num_free_blocks, kv_total_blocks=self.spec.num_blocks,
            prefill_tokens_per_s=self.prefill_rate.rate, load_tokens_per_s=self.load_rate.rate,
            decode_tokens_per_s=self.decode_rate.rate))

    def set_role(self, role: WorkerRole) -> None:
        self.spec = WorkerSpec(**{**self.spec.__dict__, "role": role})
        self.info = WorkerInfo(self.worker_id, self.info.address, role, "sim", self.namespace,
                               self.spec.block_size, self.spec.num_blocks, self.spec.max_model_len)
        self.load.info = self.handle.info = self.info

    def set_draining(self, draining: bool) -> None:
        """Marked draining (a role change or a stop under way), the router sends it nothing."""
        self.info = dataclasses.replace(self.info, draining=draining)
        self.load.info = self.handle.info = self.info

    # --- requests --------------------------------------------------------------------------
    def submit(self, t: float, choice: Any, phase: Phase, prompt: Sequence[int],
               outputs: Sequence[int], max_tokens: int, books: Any, namespace: BlockKey,
               keys: Sequence[BlockKey] = ()) -> None:
        """A phase arrives at this worker at ``t`` (``namespace``: the salted one; ``keys``: the
        prompt's block keys the router computed, so they are hashed once)."""
        rid = f"{choice.request_id}/{phase}/{len(outputs)}"
        n_max = len(outputs) + 1 if phase == "prefill" else max_tokens
        params = SamplingParams(max_tokens=n_max, temperature=0.0, ignore_eos=True)
        req = Request(rid, prompt, params, namespace=namespace, block_size=self.spec.block_size,
                      output_token_ids=outputs, arrival_time=t, prefix_keys=keys)
        self.phases[rid] = PhaseState(choice, phase, req, books)
        self.scheduler.add(req)
        self.wake(t)

    def wake(self, t: float) -> None:
        if not self.busy and self.scheduler.has_unfinished():
            self._start_step(t)

    def _start_step(self, t: float) -> None:
        self.now = t
        out = self.scheduler.schedule()
        if not out.chunks:
            return  # waiting for room that a finished request frees, or for a load: woken then
        decodes, chunks, prefill_tokens = [], [], 0
        for c in out.chunks:
            st = self.phases.get(c.request.request_id)
            if st is not None and st.admitted_at is None:
                st.admitted_at = t
            if c.num_tokens == 1 and c.start_pos >= c.request.num_initial_tokens - 1:
                decodes.append(c.start_pos)
            else:
                chunks.append((c.num_tokens, c.start_pos))
                prefill_tokens += c.num_tokens
        compute = self.costs.step_s(decodes, chunks)
        dt = compute
        if prefill_tokens:
            self.prefill_rate.update(prefill_tokens, compute * prefill_tokens / (prefill_tokens + len(decodes)))
        if decodes:
            self.decode_rate.update(len(decodes), compute * len(decodes) / (prefill_tokens + len(decodes)))
        self.busy = True
        self.busy_s += dt
        self.steps += 1
        self.schedule(t + dt, lambda: self._end_step(t + dt, out))

    def _end_step(self, t: float, out: SchedulerOutput) -> None:
        self.now = t
        n = len(out.sampled_chunks)
        updated = self.scheduler.postprocess(out, SamplerOutput([OUTPUT_TOKEN] * n, [None] * n))
        for req in updated:
            st = self.phases.get(req.request_id)
            if st is None:
                continue
            if st.first_token_at is None:
                st.first_token_at = t
            if st.phase != "prefill":
                self._on_tokens(st, t)
            if req.is_finished:
                self._finish(st, t)
        self.busy = False
        self._publish(t)
        self.wake(t)

    def _finish(self, st: PhaseState, t: float) -> None:
        """The phase's final line: once its saves completed (a prefill's tokens with it)."""
        done = max(t, st.saves_done_at)
        r = st.request
        p = r.stats
        admitted = st.admitted_at if st.admitted_at is not None else t
        stats = RequestStats(
            computed_prompt_tokens=p.computed_prompt_tokens, device_hit_tokens=p.device_hit_tokens,
            store_hit_tokens=p.store_hit_tokens, store_load_s=st.load_s,
            queue_s=admitted - p.arrival_time,
            prefill_s=(st.first_token_at or t) - admitted,
            first_token_s=(st.first_token_at or t) - p.arrival_time)

        def final() -> None:
            del self.phases[r.request_id]
            self.load.observe_stats(stats)
            self._on_finished(st, done)
            self._publish(done, force=True)

        if done > t:
            self.schedule(done, final)
        else:
            final()
