"""``Daemon``: one store node as ``kvstore serve`` runs it: a ``BlockStore``, its
``StoreServer``, the Prometheus metrics server, the etcd registration, and with ``--etcd`` the
repairer and drainer (``kvstore.daemon.repair``, ``kvstore.daemon.drain``).

``start()`` binds every listener before it registers, so a registered node accepts; ``stop()``
deregisters first, then stops accepting, lets in-flight operations finish and closes the
store (LMDB cleanly). Listening errors name what could not listen and why
(``kvstore.daemon.cli`` turns them into one line and a non-zero exit).
"""

from __future__ import annotations

import errno
import logging
import threading
from typing import TYPE_CHECKING, Any

from kvstore.daemon.config import ServerConfig, format_size
from kvstore.net.address import advertised_host, is_wildcard, join_host_port

if TYPE_CHECKING:  # imported when started, so that `kvstore --help` stays quick
    from kvstore.coord.registration import Registration
    from kvstore.daemon.drain import Drainer
    from kvstore.daemon.metrics import StoreMetrics
    from kvstore.daemon.repair import Repairer
    from kvstore.net.server import StoreServer
    from kvstore.node.store import BlockStore

__all__ = ["Daemon"]

log = logging.getLogger("kvstore")


class Daemon:
    """One store node: BlockStore + StoreServer + metrics + etcd registration.

    ``start()`` first removes the stale arenas of dead daemons (``arena.remove_stale_arenas``),
    then brings them up in that order and returns once the node accepts connections;
    ``stop()`` takes them down (see the module docstring). No signal handlers here: the
    caller owns the process.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store: BlockStore | None = None
        self.server: StoreServer | None = None
        self.metrics: StoreMetrics | None = None
        self.registration: Registration | None = None
        self.repairer: Repairer | None = None
        self.drainer: Drainer | None = None
        self.drained = threading.Event()  # set once a drain finished: stop() and exit
        self._thread: threading.Thread | None = None
        self.node_id: str | None = None

    def start(self) -> "Daemon":
        from kvstore.daemon.identity import resolve_node_id
        from kvstore.daemon.metrics import StoreMetrics
        from kvstore.net.server import StoreServer, raise_nofile_limit
        from kvstore.node.arena import remove_stale_arenas
        from kvstore.node.store import BlockStore, StoreConfig

        c = self.config
        node_id = self.node_id = resolve_node_id(c.ssd_path, c.node_id)
        raise_nofile_limit(c.limits.max_connections + 256)  # sockets, LMDB, the arena, logs
        remove_stale_arenas()  # of daemons that died without unlinking theirs (arena.py)
        store = self.store = BlockStore(StoreConfig(memory_bytes=c.memory_bytes, ssd_path=c.ssd_path,
                                                    ssd_capacity_bytes=c.ssd_capacity_bytes,
                                                    gpu_memory_bytes=c.gpu_memory_bytes,
                                                    on_corrupt_ssd=c.on_corrupt_ssd,
                                                    shared_index=c.shared_index))
        try:
            server = self.server = StoreServer(store, host=c.host, port=c.port, node_id=node_id,
                                               auth_token=c.auth_token, limits=c.limits, tls=c.tls,
                                               ucx=c.ucx)
            metrics = self.metrics = StoreMetrics(store.stats, lambda: server.connection_count)
            server.metrics = metrics
            try:
                server.bind()
            except OSError as e:
                raise _listen_error("clients", c.host, c.port, e) from None
            if c.metrics_port is not None:
                try:
                    metrics.serve(c.metrics_port, c.host)
                except OSError as e:
                    raise _listen_error("/metrics", c.host, c.metrics_port, e) from None
            self._thread = threading.Thread(target=server.serve_forever,
                                            name="kvstore-accept", daemon=True)
            self._thread.start()
            if c.etcd:
                self._register(c.etcd, node_id, server.host_id)
        except BaseException:
            self.stop()
            raise
        return self

    def _bound(self) -> tuple[str, int]:
        assert self.server is not None and self.server.address is not None, "start() first"
        return self.server.address

    @property
    def address(self) -> str:
        host, port = self._bound()
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def advertised_address(self) -> str:
        """What etcd gets: ``--advertise`` (host:port) as given, else the bound port at
        ``--advertise-address``, or at the host's primary address when bound to a wildcard
        (``kvstore.net.address``)."""
        if self.config.advertise:
            return self.config.advertise
        host, port = self._bound()
        return join_host_port(advertised_host(host, self.config.advertise_address), port)

    def _reported_address(self) -> str:
        """The ready line's address: the bound one, or the advertised one when bound to a
        wildcard (where the bound one reaches nothing)."""
        host, port = self._bound()
        if is_wildcard(host):
            return join_host_port(advertised_host(host, self.config.advertise_address), port)
        return self.address

    def ready_line(self) -> str:
        """The line ``kvstore serve`` prints once the node accepts connections (module docstring)."""
        assert self.store is not None and self.metrics is not None, "start() first"
        c = self.config
        metrics = f"{c.host}:{self.metrics.port}" if self.metrics.port else "-"
        return (f"kvstore ready address={self._reported_address()} node_id={self.node_id} "
                f"arena={self.store.arena.name} memory={format_size(c.memory_bytes)} "
                f"metrics={metrics}")

    def _register(self, etcd: str, node_id: str, host_id: str) -> None:
        from kvstore.coord.registration import register

        c = self.config
        tiers = ["host"] + (["ssd"] if c.ssd_path else []) + (["gpu"] if c.gpu_memory_bytes else [])
        value = {"address": self.advertised_address(), "host_id": host_id, "node_id": node_id,
                 "capacity": {"memory": c.memory_bytes, "ssd": c.ssd_capacity_bytes,
                              "gpu": c.gpu_memory_bytes},
                 "tiers": tiers,
                 "transports": ["tcp", "shm"] + (["ucx"] if c.ucx else [])
                 + (["cuda_ipc"] if c.gpu_memory_bytes else [])}  # same host, GPU tier: gpu_ops
        self.registration = register(etcd, c.cluster, "stores", node_id, value,
                                     ttl=c.registration_ttl)
        self._start_replication(etcd, node_id, value)

    def _start_replication(self, etcd: str, node_id: str, value: dict[str, Any]) -> None:
        from kvstore.coord import settings
        from kvstore.daemon.drain import Drainer
        from kvstore.daemon.repair import Repairer

        c = self.config
        assert self.store is not None and self.metrics is not None and self.registration
        self.repairer = Repairer(self.store, node_id, etcd, c.cluster, auth_token=c.auth_token,
                                 metrics=self.metrics.repair, rate=c.repair_rate,
                                 interval=c.repair_interval, settle=c.repair_settle).start()
        assert self.repairer.cluster is not None
        ec = self.repairer.cluster.etcd
        if c.replicas is not None:
            settings.seed(ec, c.cluster, c.replicas)
        self.drainer = Drainer(ec, c.cluster, node_id, self.registration, value, self.repairer,
                               on_done=self.drained.set).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop_accepting()
        for part in (self.drainer, self.repairer):
            if part is not None:
                part.close()
        self.drainer = self.repairer = None
        if self.registration is not None:
            self.registration.close()  # before the drain (module docstring); never raises
            self.registration = None
        if self.server is not None:
            self.server.shutdown(self.config.drain_timeout)
            if self._thread is not None:
                self._thread.join(timeout=2.0)
        if self.metrics is not None:
            self.metrics.close()
        if self.store is not None:
            self.store.close()
            self.store = None


def _listen_error(what: str, host: str, port: int, e: OSError) -> OSError:
    hint = " (another process holds it: stop it or pick another port)" if e.errno == errno.EADDRINUSE else ""
    return OSError(e.errno, f"cannot listen for {what} on {host}:{port}: {e.strerror}{hint}")
