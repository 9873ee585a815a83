"""``kvrouter up --hosts N``: the local cluster spread over N hosts of the hosts harness.

Each host is a :class:`~router.cluster.hosts.Host` (a network namespace on a bridge, a private
``/dev/shm``, its own hostname). :class:`MultiHostCluster` is a
:class:`~router.cluster.launcher.LocalCluster` whose children run inside hosts:

- host 0: etcd (``http://ADDR0:2379``), its store daemon, its workers and the router
  (``http://ADDR0:PORT``, reachable from the root namespace through the bridge);
- every host i: a store daemon ``store-i`` (``ADDRi:7700``, Prometheus on ``ADDRi:9100``) and
  the workers its roles name (``ADDRi:8100``, ``8101``...). The default layout is one
  prefill worker on host 0 and one decode worker on each other host (``--host-roles
  prefill,decode,decode`` for 3 hosts; ``prefill+decode,decode`` puts two on host 0).

Every child binds its host's address, so what it registers in etcd (the bound address) is
what the other hosts reach. A worker finds the stores in etcd and reaches the one on its
own host over shared memory (same ``host_id``), the others over TCP: the client's choice,
nothing configured here. A child runs as ``nsenter ... -- ARGV`` (``Host.command``): its pid
is the program's own, and the supervisor's restart (the same command line) starts it again
inside the same host. ``cluster.json`` names each child's host (``"host"``) and lists the
hosts (``"hosts"``: name, address, roles) and each store's metrics URL (``"store_metrics"``).

Ports are fixed per host (a fresh network namespace holds nothing but what we start). The
hosts need root; a machine where they cannot be made fails ``start()`` with ``LaunchError``
quoting why. ``stop()`` stops every child, then tears the hosts down (namespaces, veths,
bridge, whatever still runs in them), also after a failed start. The children bind beyond
loopback, so a cluster secret is required (no ``--no-cluster-secret``). TLS (``--tls-dir``):
once the hosts exist, the CA in that directory issues ``hosts-node.pem`` naming every host's
address, and every child (etcd on https with client certificates, the stores, the workers,
the router's internal calls) uses it; ``--tls-cert/--tls-key/--tls-ca`` alone are refused,
having no CA key to name the hosts with. Only the
disaggregated and auto modes (one worker per role entry); colocated is one worker, not a
multi-host layout.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from kvstore.daemon.config import parse_size
from router.cluster.child import ChildProcess, parse_cpus
from router.cluster.hosts import Host, Hosts, HostsError
from router.cluster.launcher import ClusterSpec, LaunchError, LocalCluster

__all__ = ["MultiHostCluster", "parse_host_roles", "default_host_roles", "ETCD_PORT", "STORE_PORT",
           "STORE_METRICS_PORT", "WORKER_PORT"]

ETCD_PORT, ETCD_PEER_PORT = 2379, 2380
STORE_PORT, STORE_METRICS_PORT = 7700, 9100
WORKER_PORT = 8100          # the first worker of a host; the next ones count up
_ROLES: tuple[str, ...] = ("prefill", "decode")
_SHM_SLACK = 64 << 20       # a host's /dev/shm: the store's arena and this much more


def default_host_roles(n: int) -> list[list[str]]:
    """One prefill worker on host 0 and one decode worker on every other host (one host:
    both on it)."""
    if n < 1:
        raise ValueError(f"--hosts must be >= 1, got {n}")
    return [["prefill", "decode"]] if n == 1 else [["prefill"]] + [["decode"]] * (n - 1)


def parse_host_roles(text: str, n: int) -> list[list[str]]:
    """``"prefill,decode,decode"`` (one entry per host, roles joined by ``+``, an empty entry
    for a host with a store and no worker) -> roles per host."""
    entries = text.split(",")
    if len(entries) != n:
        raise ValueError(f"--host-roles has {len(entries)} entries for {n} hosts: {text!r}")
    layout = [[r.strip() for r in e.split("+") if r.strip()] for e in entries]
    bad = sorted({r for roles in layout for r in roles if r not in _ROLES})
    if bad:
        raise ValueError(f"--host-roles: unknown role(s) {', '.join(bad)}; each is prefill or decode")
    return layout


class MultiHostCluster(LocalCluster):
    """``LocalCluster`` over ``len(host_roles)`` hosts (module docstring)."""

    def __init__(self, spec: ClusterSpec, host_roles: Sequence[Sequence[str]],
                 on_status: Callable[[str], None] | None = None) -> None:
        layout = [list(roles) for roles in host_roles]
        if not layout:
            raise ValueError("a multi-host cluster needs at least one host")
        if spec.mode == "colocated":
            raise ValueError("--hosts runs the disaggregated or auto mode; colocated is one worker")
        if spec.insecure:
            raise ValueError("--hosts binds every child beyond loopback: it needs a cluster secret "
                             "(drop --no-cluster-secret)")
        if spec.etcd is not None:
            raise ValueError("--hosts starts its own etcd on host 0 (drop --etcd)")
        if spec.tls is not None and not (Path(spec.tls.ca).parent / "ca-key.pem").is_file():
            raise ValueError("--hosts with TLS needs --tls-dir (its CA key issues the certificate "
                             "naming every host's address once the hosts exist), not --tls-cert/"
                             "--tls-key/--tls-ca alone")
        counts = {role: sum(r == role for roles in layout for r in roles) for role in _ROLES}
        spec = dataclasses.replace(spec, prefill=counts["prefill"], decode=counts["decode"])
        super().__init__(spec, on_status)
        self.host_roles = layout
        self.hosts: Hosts | None = None
        self._worker_host: dict[str, int] = {}   # worker name -> host index
        seen: dict[str, int] = dict.fromkeys(_ROLES, 0)
        for i, roles in enumerate(layout):
            for role in roles:
                self._worker_host[f"{role}-{seen[role]}"] = i
                seen[role] += 1
        self._next_port: dict[int, int] = {}
        self._placement: dict[str, int] = {}     # child name -> host index, for the next _spawn

    # -- lifecycle -----------------------------------------------------------------------
    def _start(self) -> None:
        n = len(self.host_roles)
        shm = parse_size(self.spec.store_memory) + _SHM_SLACK
        try:
            self.hosts = Hosts(n, shm_size=str(shm)).start()
        except (HostsError, OSError) as exc:
            raise LaunchError(f"cannot make {n} hosts (network namespaces; needs root): {exc}") from exc
        self.router_host = self.hosts[0].address
        self.state_extra["bridge"] = {"name": self.hosts.bridge, "address": self.hosts.bridge_address}
        self.state_extra["hosts"] = [{"name": h.name, "address": h.address, "roles": roles}
                                     for h, roles in zip(self.hosts, self.host_roles)]
        self.state_extra["store_metrics"] = {f"store-{i}": f"http://{h.address}:{STORE_METRICS_PORT}/metrics"
                                             for i, h in enumerate(self.hosts)}
        if self.spec.tls is not None:   # every child serves on its host's address: name them all
            from kvstore.certs import make_node

            named = make_node(Path(self.spec.tls.ca).parent, "hosts-node",
                              ips=[h.address for h in self.hosts])
            self.spec = dataclasses.replace(self.spec, tls=named)
            self.on_status(f"TLS certificate for every host's address: {named.cert}")
        self.on_status(f"{n} hosts on bridge {self.hosts.bridge} ({self.hosts.bridge_address}): "
                       + ", ".join(f"{h.name} {h.address} [{'+'.join(r) or 'store only'}]"
                                   for h, r in zip(self.hosts, self.host_roles)))
        super()._start()

    def stop(self) -> None:
        """Every child, then the hosts; idempotent. The launcher's order (router, workers,
        stores, etcd), each kind's children stopped at once rather than one by one."""
        try:
            for kinds in (("router",), ("prefill", "decode"), ("store",)):
                wave = [c for c in self.children if c.kind in kinds and c.alive()]
                for c in wave:
                    c.deliberate = True
                threads = [threading.Thread(target=c.stop, args=(self.spec.stop_timeout,))
                           for c in wave]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                for c in wave:
                    self.on_status(f"stopped {c.name} (exit {c.returncode})")
            super().stop()   # what is left (etcd), the secret file, cluster.json
        finally:
            if self.hosts is not None:
                self.hosts.close()
                self.hosts = None

    # -- where children run ----------------------------------------------------------------
    def _host(self, i: int) -> Host:
        assert self.hosts is not None
        return self.hosts[i]

    def _spawn_on(self, i: int, name: str, kind: str, argv: list[str], address: str, *,
                  env: dict[str, str] | None = None, cpus: frozenset[int] | None = None,
                  ready_pattern: str | None = None) -> ChildProcess:
        self._placement[name] = i
        return self._spawn(name, kind, argv, address, env=env, cpus=cpus, ready_pattern=ready_pattern)

    def _spawn(self, name: str, kind: str, argv: list[str], address: str, *,
               env: dict[str, str] | None = None, cpus: frozenset[int] | None = None,
               ready_pattern: str | None = None) -> ChildProcess:
        # Placed by _spawn_on; anything else the LocalCluster API starts (the router, another
        # router) runs on host 0.
        host = self._host(self._placement.pop(name, 0))
        self.child_hosts[name] = host.name
        return super()._spawn(name, kind, host.command(argv), address, env=env, cpus=cpus,
                              ready_pattern=ready_pattern)

    def _router_port_taken(self, port: int) -> bool:
        return False   # host 0 is a fresh network namespace: nothing there but our children

    # -- parts ----------------------------------------------------------------------------
    def _etcd_ports(self) -> tuple[str, int, int]:
        return self._host(0).address, ETCD_PORT, ETCD_PEER_PORT   # _spawn puts etcd on host 0

    def _start_store(self) -> None:
        spec = self.spec
        started = []
        for i, host in enumerate(self.hosts or ()):   # all at once, then each waited for
            started.append(self._spawn_on(i, f"store-{i}", "store", self._py(
                "kvstore.daemon.cli", "serve", "--host", host.address, "--port", str(STORE_PORT),
                "--memory", spec.store_memory, "--etcd", self._etcd(), "--cluster", spec.cluster,
                "--metrics-port", str(STORE_METRICS_PORT), *spec.store_args), f"{host.address}:{STORE_PORT}",
                ready_pattern=rf"^kvstore ready address=\S*:{STORE_PORT} node_id=(?P<id>\S+)"))
        for i, child in enumerate(started):
            self._wait(child, lambda c=child: self.is_ready(c))
            self.on_status(f"{child.name} ready on {child.address} (host {i}, {spec.store_memory} "
                           f"host memory, node_id {child.member_id})")

    def _spawn_worker(self, name: str, role: str) -> ChildProcess:
        spec = self.spec
        i = self._worker_host[name]
        host = self._host(i)
        port = self._next_port.get(i, WORKER_PORT)
        self._next_port[i] = port + 1
        threads = str(spec.threads_per_worker)
        cpus_text = {"prefill": spec.prefill_cpus, "decode": spec.decode_cpus}[role]
        url = f"{'https' if self.spec.tls else 'http'}://{host.address}:{port}"
        return self._spawn_on(i, name, role, self._py(
            "engine.worker.cli", "serve", "--role", role, "--model", str(self.model_dir),
            "--host", host.address, "--port", str(port), "--etcd", self._etcd(),
            "--cluster", spec.cluster, "--threads", threads, *spec.worker_args), url,
            env={"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                 "TOKENIZERS_PARALLELISM": "false"},
            cpus=parse_cpus(cpus_text) if cpus_text else None,
            ready_pattern=rf"^kvengine ready address=https?://\S*:{port} worker_id=(?P<id>\S+)")
