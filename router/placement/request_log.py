"""One structured log record per request: its timeline, where its KV came from, what moved.

Every request the router serves leaves exactly one JSON object (one line) when it ends,
however it ends (finished, stopped by a stop string, aborted by the client, failed). The
benchmarks read these lines, so the field names below are a contract:

``request_id``, ``mode`` (the ``router.placement.route.Route``: ``disaggregated`` | ``colocated``
| ``auto-local`` | ``auto-remote`` | ``store-down``: the store was down, so the decode worker
prefilled a request that would have been disaggregated; null when the request failed before
it was placed),
``arrival_unix`` (wall clock at arrival), ``timeline`` (seconds since arrival, monotonic clock):
``queued`` (0.0), ``prefill_start``, ``prefill_end`` (the prefill's first token; in a
``phase="full"`` run, the worker's first token), ``transfer_start`` (decode request sent: the
decode worker starts by loading the prompt's blocks from the store), ``decode_first`` (first
token from the decode worker), ``first_token`` (first token handed on to the client),
``decode_end``, ``end``; absent when a phase did not happen. Each is the first occurrence
(a resumed decode does not move them).
``prompt_tokens``, ``output_tokens``, ``finish_reason``, ``status`` (``ok``; ``closed``: the
caller stopped reading, at a stop string or a client disconnect; ``error``), ``error``,
``prefill_worker``, ``decode_workers`` (in order: more than one after a resume),
``prefill_retries``, ``decode_resumes``, ``prefill_stats`` (the stats of the prefill, or full,
phase that finished) and ``decode_stats`` (those of the decode phases that finished, summed:
more than one after a resume), each an ``engine.api.generate.RequestStats`` with its names
(``computed_prompt_tokens``, ``device_hit_tokens``, ``store_hit_tokens``, ``kv_bytes_loaded``,
``kv_bytes_saved``, ``store_load_s``, ``store_save_s``, ``queue_s``, ``prefill_s``,
``first_token_s``; zeros where no such phase finished: a request's KV bytes or device hits
over all its phases are the two sides' sum), ``phases`` (each worker phase in order:
``worker_id``, ``phase``, ``ok``, ``error``, ``output_tokens`` it produced, and the worker's
final ``stats``; a failed phase has ``ok: false`` and no stats).

Records go to the ``kvrouter.requests`` logger (the application decides its handlers) and,
when a path is given, are appended to a JSONL file. The sink never raises into the serving
path: a log that cannot be written is reported once on the module logger.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field, fields
from typing import IO, Any

from engine.api.generate import GenerateRequest, Phase, RequestStats
from router.placement.route import Route
from router.workers.load import Assignment
from router.workers.pool import WorkerHandle

__all__ = ["PhaseRun", "RequestRecord", "RequestLog"]

_logger = logging.getLogger(__name__)
records_logger = logging.getLogger("kvrouter.requests")


@dataclass(eq=False, slots=True)
class PhaseRun:
    """One worker phase (a prefill, a decode, a resumed decode, a full run): where, what was
    sent, what it holds in the books, and how it ended: ``error`` when it failed, the worker's
    final ``stats`` when it finished. The request log writes it (:meth:`to_dict`)."""

    worker: WorkerHandle
    phase: Phase
    request: GenerateRequest
    books: Assignment
    output_tokens: int = 0                             # output tokens it streamed
    error: str | None = None
    stats: RequestStats | None = None                  # its final line's; None unless it finished

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        """Its entry in the request log's ``phases``; a failed phase has no stats."""
        return {"worker_id": self.worker_id, "phase": self.phase, "ok": self.ok,
                "error": self.error, "output_tokens": self.output_tokens,
                "stats": self.stats.to_json() if self.stats is not None else {}}


@dataclass
class RequestRecord:
    """The mutable record of one request while it runs; ``to_json`` when it ends."""

    request_id: str
    mode: Route | None = None        # how it was served, once it was placed
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    status: str = "ok"
    error: str | None = None
    prefill_worker: str | None = None
    decode_workers: list[str] = field(default_factory=list)
    prefill_retries: int = 0
    decode_resumes: int = 0
    phases: list[PhaseRun] = field(default_factory=list)   # each that ended, in order
    arrival_unix: float = field(default_factory=time.time)
    _t0: float = field(default_factory=time.monotonic, repr=False)
    timeline: dict[str, float] = field(default_factory=lambda: {"queued": 0.0})

    def mark(self, event: str, *, once: bool = True) -> None:
        """Record ``event`` at the current time (the first occurrence only, unless ``once=False``)."""
        if once and event in self.timeline:
            return
        self.timeline[event] = round(time.monotonic() - self._t0, 6)

    @property
    def prefill_stats(self) -> RequestStats:
        """The finished prefill (or full) phase's stats (at most one finishes)."""
        return RequestStats.total(p.stats for p in self.phases if p.stats is not None and p.phase != "decode")

    @property
    def decode_stats(self) -> RequestStats:
        """The finished decode phases' stats, summed."""
        return RequestStats.total(p.stats for p in self.phases if p.stats is not None and p.phase == "decode")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        out["timeline"] = dict(self.timeline)
        out["decode_workers"] = list(self.decode_workers)
        out["phases"] = [p.to_dict() for p in self.phases]
        out["prefill_stats"] = self.prefill_stats.to_json()
        out["decode_stats"] = self.decode_stats.to_json()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), default=str)


class RequestLog:
    """Where finished ``RequestRecord`` s go: the ``kvrouter.requests`` logger and a JSONL file.

    ``path=None`` writes to the logger only. Thread-safe; ``close()`` flushes the file.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._failed = False

    def emit(self, record: RequestRecord) -> None:
        line = record.to_json()
        records_logger.info(line)
        if self.path is None or self._failed:
            return
        try:
            with self._lock:
                if self._file is None:
                    self._file = open(self.path, "a", encoding="utf-8", buffering=1)
                self._file.write(line + "\n")
        except OSError as exc:
            self._failed = True
            _logger.error("request log %s cannot be written (%s); records go to the logger only",
                          self.path, exc)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
