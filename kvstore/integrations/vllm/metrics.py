"""The connector's counters on vLLM's own paths: its periodic log line and its Prometheus
``/metrics`` (``vllm:kvstore_*_total``), through vLLM's ``KVConnectorStats`` /
``KVConnectorPromMetrics`` seams.

Each step the worker side hands vLLM the growth of its ``TransferStats`` since the last step
(``KVStoreConnectorStats``, a dict of numbers: serializable, summed on aggregation); vLLM's
logger process adds them to one Prometheus counter per field, labelled by engine as vLLM
labels its own. Imports vLLM: loaded only by ``connector``.
"""
# pyright: reportMissingImports=false

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvstore.integrations.vllm.transfers import TransferStats

__all__ = ["KVStoreConnectorStats", "KVStorePromMetrics", "FIELDS"]

FIELDS = tuple(f.name for f in fields(TransferStats))
_HELP = {
    "loads": "Store loads (one per request that loaded blocks)",
    "loaded_blocks": "Blocks loaded from the store, verified",
    "loaded_bytes": "Bytes of KV loaded from the store",
    "load_s": "Seconds spent loading from the store",
    "failed_blocks": "Blocks that failed to load (missing, corrupt, unreachable): recomputed",
    "corrupt_blocks": "Blocks that failed verification",
    "waited_s": "Seconds decodes waited for a prefill's blocks",
    "saved_blocks": "Blocks saved to the store",
    "skipped_blocks": "Blocks not saved: the store held them",
    "saved_bytes": "Bytes of KV saved to the store",
    "save_s": "Seconds spent saving to the store",
    "save_failed_blocks": "Blocks whose save failed (dropped)",
    "store_errors": "Store calls that failed",
}


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """The growth of the worker side's counters over an interval (``data``: field -> number)."""

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.data.items() if v}


def delta(now: TransferStats, before: TransferStats) -> dict[str, float]:
    return {k: getattr(now, k) - getattr(before, k) for k in FIELDS}


class KVStorePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {k: self._counter_cls(name=f"vllm:kvstore_{k}", documentation=_HELP.get(k, k),
                                               labelnames=labelnames) for k in FIELDS}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        for k, v in transfer_stats_data.items():
            counter = self._counters.get(k)
            if counter is not None and v:
                counter.labels(*labels).inc(v)
