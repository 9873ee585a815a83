"""The store as a vLLM V1 KV connector: ``KVStoreConnector``, loaded by vLLM's own
configuration with nothing in vLLM patched (docs/integrations.md shows it as the tests load it)::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": "127.0.0.1:7700"}}'

``kv_role``: ``kv_both`` and ``kv_producer`` load store hits and save what they compute;
``kv_consumer`` (a P/D decode) only loads. ``kv_load_failure_policy: recompute`` is required:
a block the store lost between lookup and load is recomputed, never a failed request.
``kv_connector_extra_config``: ``address`` or ``etcd`` (+ ``cluster``), ``secret_file``,
``transport``, ``timeout`` (``kvstore.integrations.store_link``), ``handoff_wait_s`` (how long
a decode waits for a prefill's blocks, default 30), ``namespace`` (an extra string in the
namespace facts; two deployments that must never share blocks set different ones),
``register`` (the instance in the cluster's etcd, for the router:
``kvstore.integrations.vllm.registration``), ``load_threads`` (threads a shared-memory load
verifies and copies on, default 2).

The scheduler side is ``kvstore.integrations.vllm.scheduler`` and the worker side
``kvstore.integrations.vllm.transfers`` over ``kvstore.integrations.vllm.layout``; this class
only maps vLLM's calls onto them, and reports the worker side's counters through vLLM's
stats and Prometheus seams (``metrics``). Only this module and ``metrics`` import vLLM.
"""
# pyright: reportMissingImports=false

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.integrations.store_link import StoreLink, StoreSettings
from kvstore.integrations.vllm.layout import BlockLayout
from kvstore.integrations.vllm.metrics import KVStoreConnectorStats, KVStorePromMetrics, delta
from kvstore.integrations.vllm.registration import InstanceRegistration, RegisterSettings
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.specs import LoadSpec, SaveSpec, for_rank
from kvstore.integrations.vllm.transfers import Transfers, TransferStats
from kvstore.keys import namespace_id
from kvstore.weights import files_digest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata"]

log = logging.getLogger(__name__)


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        where = "kv_connector_extra_config"
        self.settings = StoreSettings.from_mapping(extra, where)
        if ktc.kv_load_failure_policy != "recompute":
            raise ValueError("KVStoreConnector needs \"kv_load_failure_policy\": \"recompute\" in "
                             "--kv-transfer-config: a block the store lost is recomputed, "
                             "never a failed request")
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"KVStoreConnector serves models with one KV cache group (full "
                             f"attention); this model has {len(groups)} (hybrid or sliding window)")
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.num_blocks = kv_cache_config.num_blocks
        self.handoff_wait_s = float(extra.get("handoff_wait_s", 30.0))
        self.load_threads = int(extra.get("load_threads", 2))
        if self.load_threads < 1:
            raise ValueError(f"load_threads in {where} must be at least 1, got {self.load_threads}")
        self.scheduler_side: SchedulerSide | None = None
        self.transfers: Transfers | None = None
        self.registration: InstanceRegistration | None = None
        self._reported = TransferStats()
        self._failed: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            facts = namespace_facts(vllm_config, kv_cache_config, str(extra.get("namespace", "")))
            self.scheduler_side = SchedulerSide(
                StoreLink(self.settings), bytes(namespace_id(facts)), self.block_size,
                load=True, save=not ktc.is_kv_consumer or ktc.kv_role == "kv_both",
                handoff_wait_s=self.handoff_wait_s, tp_size=self.tp_size)
            log.info("kvstore connector (scheduler): namespace %s, block size %d, role %s",
                     namespace_id(facts).hex()[:12], self.block_size, ktc.kv_role)
            if extra.get("register") is not None:
                reg = RegisterSettings.from_mapping(extra["register"])
                self.registration = InstanceRegistration(
                    reg, worker_value(vllm_config, kv_cache_config, reg, bytes(namespace_id(facts)))).start()

    # --- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
        return self.scheduler_side.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.scheduler_side is not None
        loads, saves = self.scheduler_side.build(scheduler_output)
        return KVStoreConnectorMetadata(loads, saves)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler_side is not None
        return self.scheduler_side.finished(request)

    # --- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = BlockLayout.from_kv_caches(kv_caches, self.num_blocks)
        dtype = str(layout.dtype).removeprefix("torch.")
        self.transfers = Transfers(StoreLink(self.settings), StoreLink(self.settings), layout, dtype,
                                   load_threads=self.load_threads)
        log.info("kvstore connector (worker): %d layers' caches, %d chunks of %d bytes a block",
                 len(kv_caches), len(layout.views), layout.chunk_bytes)

    def _rank_keys(self, spec: Any) -> Any:
        if self.tp_size == 1:
            return spec
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return dataclasses.replace(spec, keys=tuple(for_rank(spec.keys, get_tensor_model_parallel_rank(),
                                                             self.tp_size)))

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self.transfers is None or not isinstance(meta, KVStoreConnectorMetadata):
            return
        for spec in meta.loads:
            self.transfers.load(self._rank_keys(spec))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # saves are taken whole once the step's forward is done (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self.transfers is None or not isinstance(meta, KVStoreConnectorMetadata):
            return
        for spec in meta.saves:
            self.transfers.save(self._rank_keys(spec))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.transfers is None:
            return None, None
        for req_id in finished_req_ids:
            self.transfers.finish(req_id)
        sent, recved, failed = self.transfers.poll()
        self._failed |= failed
        return sent or None, recved or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed = self._failed, set()
        return out

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        """The worker side's counters' growth since the last call (vLLM's log and /metrics)."""
        if self.transfers is None:
            return None
        now = self.transfers.snapshot()
        grown = delta(now, self._reported)
        self._reported = now
        stats = KVStoreConnectorStats(data=grown)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStoreConnectorStats:
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[Any, Any],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVStorePromMetrics:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.registration is not None:
            self.registration.close()
            self.registration = None
        if self.transfers is not None:
            self.transfers.close()
            self.transfers = None


def namespace_facts(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", extra: str) -> dict[str, Any]:
    """Everything that changes a block's bytes: the model's config and weights, the KV spec and
    layout, vLLM's version (its backends' layouts change between versions), the TP size."""
    from vllm.version import __version__ as vllm_version

    mc = vllm_config.model_config
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    model = Path(str(mc.model))
    files = sorted(model.glob("*.safetensors")) if model.is_dir() else []
    weights = files_digest(files) if files else f"{mc.model}@{mc.revision or 'main'}"
    return {
        "engine": "vllm", "vllm": vllm_version,
        "config": json.loads(mc.hf_config.to_json_string(use_diff=False)),
        "weights": weights,
        "kv_spec": type(spec).__name__, "block_size": spec.block_size,
        "num_kv_heads": getattr(spec, "num_kv_heads", None), "head_size": getattr(spec, "head_size", None),
        "dtype": str(getattr(spec, "dtype", "")).removeprefix("torch."),
        "cache_dtype": vllm_config.cache_config.cache_dtype,
        "kv_layout": kv_cache_config.kv_cache_layout, "device": _device_type(),
        "tp_size": vllm_config.parallel_config.tensor_parallel_size, "namespace": extra,
    }


def worker_value(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", reg: RegisterSettings,
                 namespace: bytes) -> dict[str, Any]:
    """This instance's registration: the router's ``WorkerInfo`` etcd value, engine ``vllm``."""
    mc = vllm_config.model_config
    names = mc.served_model_name
    model = names[0] if isinstance(names, (list, tuple)) else str(names or mc.model)
    value: dict[str, Any] = {
        "address": reg.url, "role": reg.role, "model": model, "namespace": namespace.hex(),
        "block_size": vllm_config.cache_config.block_size,
        "kv_capacity_blocks": kv_cache_config.num_blocks, "max_model_len": mc.max_model_len,
        "engine": "vllm",
    }
    if reg.kv_events:
        value["kv_events"] = reg.kv_events
    if reg.kv_events_replay:
        value["kv_events_replay"] = reg.kv_events_replay
    return value


def _device_type() -> str:
    from vllm.platforms import current_platform

    return str(getattr(current_platform, "device_type", os.environ.get("VLLM_TARGET_DEVICE", "")))
