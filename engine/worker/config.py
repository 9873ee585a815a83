"""WorkerConfig: one worker process's configuration, validated once, defaults in one place.

``kvengine serve`` builds it from its flags (``engine.worker.cli``); tests and launchers build it
directly. The engine's own knobs are passed through as an ``EngineConfig``
(``engine_config()``), so they are validated by the engine, not twice.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, fields
from typing import Literal

from engine.api.generate import WORKER_ROLES, WorkerRole
from engine.core.config import EngineConfig
from kvstore.client.transport import TRANSPORTS, Transport
from kvstore.secret import check_bind

__all__ = ["WorkerConfig"]


@dataclass(frozen=True)
class WorkerConfig:
    """A worker: its role, model, cache, where its store is and where it registers.

    - ``role``: what the router sends it (every worker can prefill); it may change at run
      time (``POST /role``, ``engine.worker.role``), drained first. ``prefill`` and
      ``colocated`` workers save every new full block to the store; a ``decode`` worker saves
      only for requests in phase "prefill" (``save_all`` overrides).
    - ``kv_handoff``: where a phase "prefill" request's blocks go: ``local``, the store node on
      this host, named in the final line for the decode worker to read (one hop; then copied
      on to their owners in the background), or ``owners``, their rendezvous owners
      (``engine.kv.handoff``).
    - ``store``: a store node ``host:port``; or ``etcd`` (+ ``cluster``) to find the store
      nodes registered there. Neither: no store (device prefix cache only).
    - ``etcd``: also where the worker registers (``/{cluster}/workers/{worker_id}``).
    - ``port`` 0 binds a free port (the readiness line and ``/info`` say which).
    - ``advertise_host`` (``--advertise-address``): the address registered in etcd; by
      default ``host``, or the host's primary address when ``host`` is a wildcard
      (``kvstore.net.address``).
    - ``threads``: torch intra-op threads (None: torch's default).
    - ``store_transport``: the data path to the store nodes (``kvstore.client.transport``):
      ``auto`` by the transport matrix, or ``tcp`` / ``shm`` / ``ucx`` forced.
    - ``cluster_secret``: what every caller of the worker API but ``/health`` and ``/metrics``
      must send as ``Authorization: Bearer``, and what the store client authenticates with
      (None: no authentication, allowed only on a loopback ``host`` unless ``insecure``; the
      store client then falls back to ``$KVSTORE_AUTH_TOKEN``). Never printed (``repr``).
    """

    model: str = "default"
    role: WorkerRole = "colocated"
    host: str = "127.0.0.1"
    port: int = 8100
    advertise_host: str | None = None
    worker_id: str | None = None
    store: str | None = None
    etcd: str | None = None
    cluster: str = "kvstore"
    # The engine's share: passed through as an EngineConfig, whose defaults these are.
    num_blocks: int = EngineConfig.num_blocks
    block_size: int = EngineConfig.block_size
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    enable_chunked_prefill: bool = EngineConfig.enable_chunked_prefill
    enable_prefix_caching: bool = EngineConfig.enable_prefix_caching
    max_model_len: int | None = EngineConfig.max_model_len
    dtype: str | None = EngineConfig.dtype
    device: str | None = EngineConfig.device
    kv_load_timeout_s: float = EngineConfig.kv_load_timeout_s
    threads: int | None = None
    save_all: bool | None = None
    kv_handoff: Literal["local", "owners"] = "local"
    load_interval_s: float = 0.5
    event_capacity: int = 65536
    registration_ttl_s: float = 5.0
    drain_timeout_s: float = 300.0       # SIGTERM's drain, and a role change's at most
    role_settle_s: float = 1.0           # a role change drains at least this long (routers catch up)
    cluster_secret: str | None = field(default=None, repr=False)
    insecure: bool = False
    step_trace: str | None = None        # a JSONL file of every step (engine.worker.worker)
    store_transport: Transport = "auto"  # the data path to the store (kvstore.client.transport)

    def __post_init__(self) -> None:
        if self.role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {list(WORKER_ROLES)}, got {self.role!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.store is not None and self.etcd is None and ":" not in self.store:
            raise ValueError(f"--store must be host:port, got {self.store!r}")
        if self.store_transport not in TRANSPORTS:
            raise ValueError(f"store_transport must be one of {list(TRANSPORTS)}, got {self.store_transport!r}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads must be positive, got {self.threads}")
        for name in ("load_interval_s", "registration_ttl_s", "drain_timeout_s", "role_settle_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        self.engine_config()  # validates the engine's share
        check_bind(self.host, self.cluster_secret, self.insecure, what="engine worker")

    @property
    def saves_all(self) -> bool:
        return self.saves_all_as(self.role)

    def saves_all_as(self, role: WorkerRole) -> bool:
        """Whether a worker of ``role`` saves every new full block (its role may change at
        run time, ``engine.worker.role``): ``save_all`` when given, else unless ``decode``."""
        return self.save_all if self.save_all is not None else role != "decode"

    @property
    def uses_store(self) -> bool:
        return self.store is not None or self.etcd is not None

    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{self.role}-{uuid.uuid4().hex[:8]}"

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**{f.name: getattr(self, f.name) for f in fields(EngineConfig)})
