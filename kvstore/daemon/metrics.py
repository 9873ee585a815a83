"""Prometheus metrics of the daemon, on their own ``CollectorRegistry`` (no global state).

Exported (all prefixed ``kvstore_``):

- ``op_seconds{op}``: histogram of request latency per protocol op, measured in the daemon
  from a request's meta being read to its response being sent.
- ``bytes_total{direction="in"|"out", path="tcp"|"shm"|"ucx"}``: KV bytes put into (in) and
  got out of (out) the store; on the shared-memory path counted at COMMIT and PIN, on UCX
  (``kvstore.net.ucx``) at COMMIT and once a GET's sends completed.
- ``errors_total{code}``: error answers per error code.
- From ``BlockStore.stats()`` at scrape time, per tier (``tier="host"|"ssd"|"gpu"``):
  counters ``hits_total``, ``misses_total``, ``bytes_in_total``, ``bytes_out_total``,
  ``evictions_total``, ``demotions_total`` (out of the tier), ``promotions_total`` (into
  it), ``corrupt_total``; gauges ``used_bytes``, ``allocated_bytes``, ``capacity_bytes``,
  ``blocks``; and the store-wide counters (``puts_total``, ``put_noops_total``,
  ``store_full_total``).
- ``connections``: open client connections.
- ``connections_dropped_total{reason}``: connections the daemon closed or refused, by
  reason: ``limit`` (over --max-connections), ``fd_exhausted`` (out of file descriptors),
  ``hello_timeout``, ``idle_timeout``, ``frame_timeout``.
- ``accept_errors_total``: ``accept`` failures for want of file descriptors (EMFILE/ENFILE).
- ``ssd_moved_aside_total``: damaged SSD tiers moved aside at start (from the store's stats).
- Re-replication (``kvstore.daemon.repair``): ``repair_blocks_total`` and
  ``repair_bytes_total`` (copies pushed to other nodes), ``repair_failures_total`` (copies
  that could not be pushed), ``repair_passes_total``, gauges ``repair_pending_blocks``
  (blocks of the running pass not yet checked; 0 between passes) and
  ``repair_last_pass_seconds`` (duration of the last finished pass).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from kvstore.node.stats import StoreStats

__all__ = ["StoreMetrics", "RepairMetrics"]

_LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_GAUGES = {"used_bytes", "allocated_bytes", "capacity_bytes", "blocks", "pinned_blocks"}


class _StoreCollector(Collector):
    """Reads ``BlockStore.stats()`` when Prometheus scrapes, so the numbers cannot drift.

    Each tier's fields become ``kvstore_<field>{tier}``: occupancy fields (``_GAUGES``) as
    gauges, every other number as a counter (``..._total``). Top-level numbers become
    counters without a tier label. New fields in the store's stats appear without a change
    here.
    """

    def __init__(self, stats: Callable[[], StoreStats], connections: Callable[[], int]) -> None:
        self._stats = stats
        self._connections = connections

    def collect(self) -> Iterable[Any]:
        s = dataclasses.asdict(self._stats())
        per_tier: dict[str, dict[str, float]] = {}
        for tier, t in s.items():
            if isinstance(t, dict):
                for name, v in t.items():
                    if isinstance(v, (int, float)):
                        per_tier.setdefault(name, {})[tier] = float(v)
        for name, values in sorted(per_tier.items()):
            cls = GaugeMetricFamily if name in _GAUGES else CounterMetricFamily
            fam = cls(f"kvstore_{name}", f"Store {name.replace('_', ' ')} per tier", labels=["tier"])
            for tier, v in values.items():
                fam.add_metric([tier], v)
            yield fam
        for name, v in s.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                yield CounterMetricFamily(f"kvstore_{name}", f"Store {name.replace('_', ' ')}",
                                          value=float(v))
        yield GaugeMetricFamily("kvstore_connections", "Open client connections",
                                value=float(self._connections()))


class RepairMetrics:
    """The repair pass's progress (module docstring); a registry of its own when none is given."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.blocks = Counter("kvstore_repair_blocks", "Block copies pushed to other nodes by "
                              "re-replication", registry=r)
        self.bytes = Counter("kvstore_repair_bytes", "Bytes pushed to other nodes by "
                             "re-replication", registry=r)
        self.failures = Counter("kvstore_repair_failures", "Block copies re-replication could "
                                "not push", registry=r)
        self.passes = Counter("kvstore_repair_passes", "Re-replication passes finished",
                              registry=r)
        self.pending = Gauge("kvstore_repair_pending_blocks", "Blocks of the running "
                             "re-replication pass not yet checked", registry=r)
        self.last_pass = Gauge("kvstore_repair_last_pass_seconds", "Duration of the last "
                               "finished re-replication pass", registry=r)


class StoreMetrics:
    """The daemon's metrics. ``observe``/``transferred``/``error``/``dropped``/``accept_error``
    are called by the server;
    ``serve(port)`` exposes ``/metrics`` over HTTP until ``close()``."""

    def __init__(self, stats: Callable[[], StoreStats],
                 connections: Callable[[], int] = lambda: 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._latency = Histogram("kvstore_op_seconds", "Request latency per protocol op",
                                  ["op"], registry=self.registry, buckets=_LATENCY_BUCKETS)
        self._bytes = Counter("kvstore_bytes", "KV bytes moved into (in) and out of (out) the store",
                              ["direction", "path"], registry=self.registry)
        self._errors = Counter("kvstore_errors", "Error answers per error code", ["code"],
                               registry=self.registry)
        self._dropped = Counter("kvstore_connections_dropped", "Connections closed or refused "
                                "by the daemon, per reason", ["reason"], registry=self.registry)
        self._accept_errors = Counter("kvstore_accept_errors", "accept() failures for want of "
                                      "file descriptors", registry=self.registry)
        self.repair = RepairMetrics(self.registry)
        self.registry.register(_StoreCollector(stats, connections))
        self._children: dict[tuple[str, ...], Any] = {}  # labels() once per label set
        self._httpd = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def observe(self, op: str, seconds: float) -> None:
        child = self._children.get(("op", op))
        if child is None:
            child = self._children[("op", op)] = self._latency.labels(op)
        child.observe(seconds)

    def transferred(self, direction: str, path: str, nbytes: int) -> None:
        child = self._children.get((direction, path))
        if child is None:
            child = self._children[(direction, path)] = self._bytes.labels(direction, path)
        child.inc(nbytes)

    def error(self, code: str) -> None:
        self._errors.labels(code).inc()

    def dropped(self, reason: str) -> None:
        self._dropped.labels(reason).inc()

    def accept_error(self) -> None:
        self._accept_errors.inc()

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the HTTP exporter; return the bound port (``port`` 0 picks a free one)."""
        self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._httpd.server_port
        return self.port

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
