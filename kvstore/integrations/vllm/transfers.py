"""The worker side's data path: loads into and saves out of vLLM's caches, each on a thread of
its own, so the step loop only hands work over and collects what finished.

- ``load(LoadSpec)`` queues a load. The load thread (for a P/D decode, once the store holds
  every block or ``wait_s`` has passed; such a load waits aside, holding up no other) gets
  the blocks through the loader every connector shares (``kvstore.transfer.loader``,
  ``BlockLayout`` its cache target): each is verified where it lies (the daemon's arena on
  shared memory, a receive row over TCP) and copied straight into its place in a CPU cache,
  or into a pooled host ring sent on to a CUDA cache in groups (``BlockLayout.scatter``).
  Only the leading run of verified blocks counts; the
  blocks after it are reported failed and vLLM recomputes them (its
  ``kv_load_failure_policy: recompute``). Unverified bytes never reach a cache.
- ``save(SaveSpec)`` copies the blocks out at once, into pooled put rows laid out as encoded
  blocks (payload after a 64-byte header, ``kvstore.codec.seal``), and queues them; the save
  thread skips what the store already holds, seals the rest and puts them in batches.
- ``finish(req_id)``: vLLM finished a request. One that had any load or save keeps its blocks
  (vLLM holds them for us) until ``poll`` reports it, once every transfer of it is done: an
  abort during a load never frees blocks that the load thread still writes.
- ``poll()`` returns what finished since the last call: saved requests, loaded requests and
  the block ids that failed to load.

Failure is a miss: a dead, full or slow store fails loads (recomputed) and drops saves; nothing
raises into vLLM. Counters: ``TransferStats``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvstore import codec
from kvstore.errors import KVStoreError
from kvstore.integrations.store_link import StoreLink
from kvstore.integrations.vllm.layout import BlockLayout
from kvstore.integrations.vllm.specs import LoadSpec, SaveSpec
from kvstore.transfer.loader import BlockLoader
from kvstore.transfer.staging import StagingPool

__all__ = ["Transfers", "TransferStats"]

log = logging.getLogger(__name__)

_MAX_BATCH_BYTES = 64 << 20
_POLL_S = 0.005


@dataclass
class TransferStats:
    loads: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_s: float = 0.0
    failed_blocks: int = 0          # missing, corrupt or unreachable: recomputed by vLLM
    corrupt_blocks: int = 0
    waited_s: float = 0.0           # P/D: time spent waiting for a prefill's blocks
    saved_blocks: int = 0
    skipped_blocks: int = 0         # already in the store
    saved_bytes: int = 0
    save_s: float = 0.0
    save_failed_blocks: int = 0
    store_errors: int = 0


@dataclass
class _Save:
    spec: SaveSpec
    buf: np.ndarray                 # [n, HEADER + payload] uint8: the put rows
    rows: torch.Tensor              # the pooled buffer they are the first rows of


class Transfers:
    def __init__(self, load_link: StoreLink, save_link: StoreLink, layout: BlockLayout,
                 dtype_name: str, *, load_path: str = "auto", load_threads: int = 1) -> None:
        self.layout, self.dtype_name = layout, dtype_name
        self.stats = TransferStats()
        self._load_link, self._save_link = load_link, save_link
        # The load every connector shares (verified where it lies, pooled buffers);
        # load_threads: threads a shared-memory load verifies and copies on.
        self._loader = BlockLoader(layout, dtype_name, layout.block_shape,
                                   path=load_path, threads=load_threads)  # type: ignore[arg-type]
        self._encoded = codec.HEADER_SIZE + layout.payload_bytes
        self._put_rows = StagingPool((self._encoded,), torch.uint8, pin=layout.is_cuda)
        self._lock = threading.Lock()
        self._recved: set[str] = set()
        self._failed_ids: set[int] = set()
        self._sent: set[str] = set()
        self._pending: dict[str, int] = {}   # request -> loads and saves queued, not yet done
        self._finished: set[str] = set()     # requests vLLM finished, waiting for their saves
        self._touched: set[str] = set()      # requests with a load or save, not yet finished
        self._loads: queue.Queue[LoadSpec | None] = queue.Queue()
        self._saves: queue.Queue[_Save | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._load_loop, name="kvstore-vllm-load", daemon=True),
                         threading.Thread(target=self._save_loop, name="kvstore-vllm-save", daemon=True)]
        for t in self._threads:
            t.start()

    # --- the step loop's side ------------------------------------------------------------

    def load(self, spec: LoadSpec) -> None:
        self._begin(spec.req_id)
        self._loads.put(spec)

    def save(self, spec: SaveSpec) -> None:
        """Copy ``spec``'s blocks out now (vLLM may reuse them once the step ends); put later."""
        n = len(spec.keys)
        if not n:
            return
        rows = self._put_rows.take(n)
        self.layout.gather(spec.block_ids, rows[:n, codec.HEADER_SIZE:])
        self._begin(spec.req_id)
        self._saves.put(_Save(spec, rows[:n].numpy(), rows))

    def _begin(self, req_id: str) -> None:
        with self._lock:
            self._pending[req_id] = self._pending.get(req_id, 0) + 1
            self._touched.add(req_id)

    def finish(self, req_id: str) -> bool:
        """vLLM finished ``req_id``. A request with any load or save (whose blocks vLLM holds
        for us, ``SchedulerSide.finished``) is reported by ``poll`` once they are all done;
        True when some are still in flight."""
        with self._lock:
            if req_id not in self._touched:
                return False
            self._touched.discard(req_id)
            if self._pending.get(req_id):
                self._finished.add(req_id)
                return True
            self._sent.add(req_id)
            return False

    def poll(self) -> tuple[set[str], set[str], set[int]]:
        """(requests whose saves are done, requests whose loads are done, failed block ids)
        since the last call."""
        with self._lock:
            out = self._sent, self._recved, self._failed_ids
            self._sent, self._recved, self._failed_ids = set(), set(), set()
        return out

    def close(self, timeout: float = 10.0) -> None:
        self._loads.put(None)
        self._saves.put(None)
        for t in self._threads:
            t.join(timeout)
        self._load_link.close()
        self._save_link.close()

    # --- load thread -----------------------------------------------------------------------

    def _load_loop(self) -> None:
        """Loads in arrival order; a decode's load whose blocks are not all stored yet waits
        aside (checked every ``_POLL_S``, until its ``wait_s`` ends), so it holds up no other."""
        waiting: list[tuple[float, float, LoadSpec]] = []   # (since, deadline, spec)
        while True:
            try:
                spec = self._loads.get(timeout=_POLL_S if waiting else None)
            except queue.Empty:  # only the waiting loads to look at
                pass
            else:
                if spec is None:
                    return
                if spec.wait_s > 0:
                    since = time.monotonic()
                    waiting.append((since, since + spec.wait_s, spec))
                else:
                    self._run_load(spec)
            now = time.monotonic()
            for item in list(waiting):
                since, deadline, w = item
                if now >= deadline or self._stored(w):
                    waiting.remove(item)
                    self._count(waited_s=time.monotonic() - since)
                    self._run_load(w)

    def _stored(self, spec: LoadSpec) -> bool:
        """Whether the store holds every block of ``spec`` (False while it cannot be asked)."""
        client = self._load_link.get()
        if client is None:
            return False
        try:
            return client.prefix_len(list(spec.keys)) >= len(spec.keys)
        except Exception:  # noqa: BLE001 - a store error or anything else: not yet (the load thread lives on)
            self._load_link.reset()
            return False

    def _run_load(self, spec: LoadSpec) -> None:
        try:
            good = self._load(spec)
        except Exception:  # never let one load stop the thread: the blocks are recomputed
            log.exception("kvstore: load of %d blocks failed", len(spec.keys))
            good = 0
        with self._lock:
            self._failed_ids.update(spec.block_ids[good:])
            self._recved.add(spec.req_id)
        self._done(spec.req_id)

    def _load(self, spec: LoadSpec) -> int:
        n = len(spec.keys)
        t0 = time.perf_counter()
        client = self._load_link.get()
        if client is None:
            self._count(failed_blocks=n)
            return 0
        try:
            good, _, corrupt = self._loader.load(client.get, spec.keys, spec.block_ids)
        except KVStoreError as exc:
            log.warning("kvstore: load of %d blocks failed, recomputing them: %s", n, exc)
            self._load_link.reset()
            self._count(failed_blocks=n, store_errors=1)
            return 0
        self._count(loads=1, loaded_blocks=good, loaded_bytes=good * self.layout.payload_bytes,
                    load_s=time.perf_counter() - t0, failed_blocks=n - good, corrupt_blocks=corrupt)
        return good

    # --- save thread -----------------------------------------------------------------------

    def _save_loop(self) -> None:
        while (job := self._saves.get()) is not None:
            try:
                self._save(job)
            except Exception:
                log.exception("kvstore: save of %d blocks failed", len(job.spec.keys))
                self._count(save_failed_blocks=len(job.spec.keys))
            finally:
                self._put_rows.give(job.rows)
                self._done(job.spec.req_id)

    def _save(self, job: _Save) -> None:
        keys, n = list(job.spec.keys), len(job.spec.keys)
        t0 = time.perf_counter()
        client = self._save_link.get()
        if client is None:
            self._count(save_failed_blocks=n)
            return
        try:
            held = client.contains(keys)
            todo = [i for i in range(n) if not held[i]]
            per_batch = max(1, _MAX_BATCH_BYTES // self._encoded)
            stored = 0
            for a in range(0, len(todo), per_batch):
                batch = todo[a:a + per_batch]
                for i in batch:
                    codec.seal(job.buf[i], keys[i], self.dtype_name, self.layout.block_shape)
                stored += sum(client.put([keys[i] for i in batch], [job.buf[i] for i in batch]))
        except KVStoreError as exc:
            log.warning("kvstore: save of %d blocks failed, dropped: %s", n, exc)
            self._save_link.reset()
            self._count(save_failed_blocks=n, store_errors=1)
            return
        self._count(saved_blocks=stored, skipped_blocks=n - len(todo),
                    saved_bytes=stored * self.layout.payload_bytes,
                    save_failed_blocks=len(todo) - stored, save_s=time.perf_counter() - t0)

    def _done(self, req_id: str) -> None:
        with self._lock:
            left = self._pending[req_id] - 1
            if left:
                self._pending[req_id] = left
                return
            del self._pending[req_id]
            if req_id in self._finished:
                self._finished.discard(req_id)
                self._sent.add(req_id)

    def _count(self, **delta: float) -> None:
        with self._lock:
            for k, v in delta.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def snapshot(self) -> TransferStats:
        with self._lock:
            return TransferStats(**asdict(self.stats))

    def idle(self) -> bool:
        """No load or save queued or running (tests and shutdown)."""
        with self._lock:
            return not self._pending
