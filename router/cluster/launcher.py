"""The local cluster: etcd, a store daemon, prefill and decode workers and the router as children.

``LocalCluster(spec).start()`` brings the parts up in dependency order and waits for each to
be ready before the next one starts. Ready is each child's own word, never a port that
answers (another process may hold it): etcd answers ``/health`` on the ports just chosen for
it; the store and every worker print their ready line (``kvstore ready address=...``,
``kvengine ready address=...``, printed once registered in etcd); the router logs
``serving on http://HOST:PORT`` on its port and then answers ``/health`` seeing every worker.
A router port that is taken fails ``start()`` before anything starts. ``stop()`` (or leaving
the ``with`` block) ends them in reverse order. Guarantees:

- Every child is a :class:`~router.cluster.child.ChildProcess`: its own process group,
  ``PR_SET_PDEATHSIG``, its output appended to ``{log_dir}/{name}.log``.
- A child that exits while the cluster comes up fails ``start()`` with ``LaunchError``
  naming the child and quoting the tail of its log.
- The cluster secret: ``spec.cluster_secret``, else one generated per cluster (unless
  ``spec.insecure``), written to ``{log_dir}/cluster-secret`` (0600) and handed to every
  child as ``$KVCACHE_CLUSTER_SECRET_FILE`` (never on a command line: ``ps`` shows those);
  the launcher's own ``$KVCACHE_CLUSTER_SECRET`` is not handed on, so the file wins.
  The file goes at ``stop()``.
- TLS (``spec.tls``, ``kvstore.tls``): etcd serves https and requires client certificates,
  and every child gets the settings through ``$KVCACHE_TLS_CERT``/``_KEY``/``_CA`` (paths):
  the store, the workers (https) and the router's internal calls are then TLS with mutual
  certificates; the router's public endpoint stays plain HTTP.
- ``{log_dir}/cluster.json`` says what runs now (URLs, each child's pid, address, id,
  state, restarts), rewritten on every change; benchmarks read it.
- Nothing restarts here: :class:`~router.cluster.supervisor.Supervisor` does, over
  :meth:`respawn` and :meth:`is_ready`; :meth:`stop_child` is a stop the cluster asks for
  itself, which a supervisor leaves stopped; :meth:`add_worker` starts one more worker
  (``router.cluster.autoscaler``'s levers, with role changes, live in ``router.cluster.levers``).
- Nothing process-wide happens in the constructor; signal handling belongs to the CLI.

Threads per worker are set explicitly (``--threads`` and ``OMP_NUM_THREADS``); each role's
workers may be pinned to a CPU set (``prefill_cpus``, ``decode_cpus``, ``colocated_cpus``:
``"0"``, ``"0,1"``, ``"0-3"``), applied in the child before exec.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine.api.paths import resolve_model_dir
from kvstore import secret as cluster_secret
from kvstore.coord import layout
from kvstore.coord.etcd import EtcdClient
from kvstore.daemon.config import parse_size
from kvstore.errors import KVStoreError
from kvstore.proc import free_port
from kvstore.tls import TLSConfig
from router.cluster.child import ChildProcess, parse_cpus, port_taken
from router.cluster.vllm_worker import VllmWorker

__all__ = ["ClusterSpec", "LocalCluster", "ChildProcess", "LaunchError", "parse_cpus", "SECRET_FILE_NAME",
           "STATE_FILE_NAME"]

SECRET_FILE_NAME = "cluster-secret"     # in the log directory, 0600
STATE_FILE_NAME = "cluster.json"        # in the log directory: what runs now
_WORKER_KINDS = frozenset({"prefill", "decode", "colocated"})


class LaunchError(RuntimeError):
    """A part of the local cluster did not come up; the message says which and why."""


@dataclass(frozen=True)
class ClusterSpec:
    """What ``kvrouter up`` runs. ``port=0`` picks a free port for the router."""

    port: int = 8000
    host: str = "127.0.0.1"
    prefill: int = 1
    decode: int = 1
    colocated: int = 1                   # workers in colocated mode (prefill/decode are not used there)
    mode: str = "disaggregated"          # disaggregated | colocated | auto
    policy: str = "kv-aware"
    auto_threshold: int | None = None
    model: str = "default"
    etcd: str | None = None              # an existing etcd; None starts one as a child
    cluster: str = "kvlocal"
    threads_per_worker: int = 1
    store_memory: str = "512M"
    api_key: str | None = None
    cluster_secret: str | None = None    # None: a fresh one per cluster (unless insecure)
    insecure: bool = False               # no cluster secret at all (loopback only)
    tls: TLSConfig | None = None         # mutual TLS between every part (kvstore.tls)
    request_log: str | None = None
    log_dir: str | None = None
    ready_timeout: float = 180.0
    stop_timeout: float = 10.0
    worker_args: tuple[str, ...] = ()    # extra flags for every `kvengine serve`
    store_args: tuple[str, ...] = ()     # extra flags for every `kvstore serve` (e.g. --ucx)
    router_args: tuple[str, ...] = ()    # extra flags for `kvrouter serve` (its scaling objectives)
    prefill_cpus: str | None = None      # CPU list each role's workers are pinned to
    decode_cpus: str | None = None       # (None: not pinned)
    colocated_cpus: str | None = None
    workers_by_index: bool = False       # name workers worker-0, worker-1... (their role may change)
    python: str = sys.executable
    engine: str = "kvengine"             # kvengine | vllm: what serves as each worker
    vllm_python: str = ""                # the Python whose vLLM runs (default: the repository's .venv-vllm)
    vllm_block_size: int = 32            # vLLM's CPU attention takes multiples of 32
    vllm_kv_cache: str = "1G"            # each vLLM instance's KV cache

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated", "auto"):
            raise ValueError(f"mode must be disaggregated, colocated or auto, got {self.mode!r}")
        if self.engine not in ("kvengine", "vllm"):
            raise ValueError(f"engine must be kvengine or vllm, got {self.engine!r}")
        for cpus in (self.prefill_cpus, self.decode_cpus, self.colocated_cpus):
            if cpus is not None:
                parse_cpus(cpus)
        if self.mode == "colocated":
            if self.colocated < 1:
                raise ValueError("colocated mode needs at least one worker")
            return
        if self.prefill < (1 if self.mode == "disaggregated" else 0) or self.decode < 1:
            raise ValueError(f"{self.mode} mode needs at least one decode worker"
                             + (" and one prefill worker" if self.mode == "disaggregated" else ""))
        if self.threads_per_worker < 1:
            raise ValueError("threads_per_worker must be >= 1")


class LocalCluster:
    """Starts and stops the parts of ``spec``; ``on_status(line)`` reports progress."""

    def __init__(self, spec: ClusterSpec, on_status: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.on_status = on_status or (lambda line: None)
        self.children: list[ChildProcess] = []
        self.etcd_url: str | None = spec.etcd
        self.router_url: str | None = None
        self.worker_urls: dict[str, str] = {}      # child name -> http://host:port
        self.model_dir: Path | None = None
        self.secret: str | None = None
        self.secret_file: Path | None = None
        self.state_extra: dict[str, object] = {}  # more for cluster.json (the supervisor's URL)
        self.router_host = spec.host               # the router's bind address (multihost: host 0's)
        self.child_hosts: dict[str, str] = {}      # child name -> its host (multihost only)
        self._tmp: str | None = None
        self.log_dir: Path | None = None
        self._http = httpx.Client(timeout=2.0, trust_env=False)
        self._etcd_client: EtcdClient | None = None
        self._state_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Bring every part up, each ready before the next; on failure stop what started."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        spec = self.spec
        if spec.port and self._router_port_taken(spec.port):
            raise LaunchError(f"the router's port {spec.port} on {self.router_host} is already in use (another "
                              "process listens there: an earlier cluster?); stop it or choose another --port")
        try:
            self.model_dir = resolve_model_dir(spec.model)
        except FileNotFoundError as exc:
            raise LaunchError(str(exc)) from None
        self._tmp = tempfile.mkdtemp(prefix="kvrouter-up-")
        self.log_dir = Path(spec.log_dir) if spec.log_dir else Path(self._tmp) / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.on_status(f"logs in {self.log_dir}")
        if not spec.insecure:
            self.secret = spec.cluster_secret or cluster_secret.generate()
            self.secret_file = cluster_secret.write_secret_file(self.log_dir / SECRET_FILE_NAME, self.secret)
            self.on_status(f"cluster secret in {self.secret_file} (0600; children read it "
                           f"through ${cluster_secret.ENV_FILE})")
        if spec.tls is not None:   # the launcher's own calls (etcd's /health) present it too
            self._http.close()
            self._http = httpx.Client(timeout=2.0, trust_env=False, verify=spec.tls.client_context())
            self.on_status(f"TLS with mutual certificates of {spec.tls.ca} between every part")
        if self.etcd_url is None:
            self._start_etcd()
        self._start_store()
        roles = (["colocated"] * spec.colocated if spec.mode == "colocated"
                 else ["prefill"] * spec.prefill + ["decode"] * spec.decode)
        counts: dict[str, int] = {}
        started = []
        for i, role in enumerate(roles):   # all at once: their start-up (imports, model load) overlaps
            counts[role] = counts.get(role, 0) + 1
            name = f"worker-{i}" if spec.workers_by_index else f"{role}-{counts[role] - 1}"
            started.append(self._spawn_worker(name, role))
        for child in started:
            self._wait(child, lambda c=child: self.is_ready(c))
            self.worker_urls[child.name] = child.address
            self.on_status(f"{child.kind} worker {child.name} ready at {child.address} "
                           f"(worker_id {child.member_id})")
        self.router_url = self.start_router(expect_workers=len(roles))

    def child(self, name: str) -> ChildProcess:
        """The child called ``name`` (``etcd``, ``store``, ``prefill-0``, ``router``...)."""
        for c in self.children:
            if c.name == name:
                return c
        raise KeyError(f"no child named {name!r}; have {[c.name for c in self.children]}")

    def stop(self) -> None:
        """Stop every child, the last started first (workers side by side: each is told at
        once, then each is waited for, so their drains overlap); idempotent."""
        live = [c for c in reversed(self.children) if c.proc is not None and c.proc.returncode is None]
        for i, child in enumerate(live):
            child.deliberate = True
            if child.kind in _WORKER_KINDS:   # its fellow workers next in line hear it now too
                for other in live[i:]:
                    if other.kind not in _WORKER_KINDS:
                        break
                    other.terminate()
            code = child.stop(self.spec.stop_timeout)
            self.on_status(f"stopped {child.name} (exit {code})")
        self.children.clear()
        self._http.close()
        if self._etcd_client is not None:
            self._etcd_client.close()
            self._etcd_client = None
        if self.secret_file is not None:
            self.secret_file.unlink(missing_ok=True)
            self.secret_file = None
        if self.log_dir is not None:
            (self.log_dir / STATE_FILE_NAME).unlink(missing_ok=True)
        if self._tmp is not None:
            logs_inside = self.log_dir is not None and Path(self._tmp) in self.log_dir.parents
            data = Path(self._tmp) / "etcd-data"
            shutil.rmtree(data if logs_inside else self._tmp, ignore_errors=True)
            self._tmp = None

    # -- one child at a time (the supervisor's and an autoscaler's API) ----------------
    def stop_child(self, name: str, timeout: float | None = None) -> int | None:
        """Stop ``name`` on purpose: marked deliberate first, so a supervisor that sees it
        exit leaves it stopped. Returns its exit code."""
        child = self.child(name)
        child.deliberate = True
        code = child.stop(self.spec.stop_timeout if timeout is None else timeout)
        self.on_status(f"stopped {name} on request (exit {code})")
        self.write_state()
        return code

    def add_worker(self, role: str) -> ChildProcess:
        """Start one more worker of ``role`` (``worker-N``, the first free N; an autoscaler's
        start). Readiness is then :meth:`is_ready`'s to tell."""
        names = {c.name for c in self.children}
        n = next(i for i in range(len(names) + 1) if f"worker-{i}" not in names)
        return self._spawn_worker(f"worker-{n}", role)

    def respawn(self, child: ChildProcess) -> None:
        """Start ``child`` again with the same command line, port and environment (its log
        is appended to). Readiness is then :meth:`is_ready`'s to tell."""
        if child.alive():
            raise LaunchError(f"{child.name} is still running (pid {child.pid})")
        child.start()
        self.write_state()

    def is_ready(self, child: ChildProcess) -> bool:
        """Whether this start of ``child`` serves, by its own word (never raises)."""
        try:
            if child.kind == "etcd":
                return self._http.get(f"{child.address}/health").json().get("health") == "true"
            if child.ready_match() is None:
                return False
            if child.kind == "router":
                return self._http.get(f"{child.address}/health").status_code in (200, 503)
            return True
        except (httpx.HTTPError, ValueError):
            return False

    def write_state(self, states: dict[str, str] | None = None) -> None:
        """Rewrite ``{log_dir}/cluster.json`` (atomically): URLs, the secret file, every
        child's pid, address, id, starts and ``states[name]`` (default running/exited)."""
        if self.log_dir is None:
            return
        with self._state_lock:
            children = {c.name: {"kind": c.kind, "pid": c.pid, "address": c.address, "id": c.member_id,
                                 "starts": c.starts,
                                 **({"host": self.child_hosts[c.name]} if c.name in self.child_hosts else {}),
                                 "state": (states or {}).get(c.name, "running" if c.alive() else "exited")}
                        for c in self.children}
            state = {"router": self.router_url, "etcd": self.etcd_url, "cluster": self.spec.cluster,
                     "secret_file": str(self.secret_file) if self.secret_file else None,
                     "updated_unix": time.time(), **self.state_extra, "children": children}
            tmp = self.log_dir / f".{STATE_FILE_NAME}.tmp"
            tmp.write_text(json.dumps(state, indent=1))
            os.replace(tmp, self.log_dir / STATE_FILE_NAME)

    # -- parts -------------------------------------------------------------------------
    def _spawn(self, name: str, kind: str, argv: list[str], address: str, *,
               env: dict[str, str] | None = None, cpus: frozenset[int] | None = None,
               ready_pattern: str | None = None) -> ChildProcess:
        assert self.log_dir is not None
        env = dict(env or {})
        if self.secret_file is not None:   # a path, not the value: nothing in argv or env to read
            env[cluster_secret.ENV_FILE] = str(self.secret_file)
        if self.spec.tls is not None:       # paths too (kvstore.tls)
            env.update(self.spec.tls.environ())
        child = ChildProcess(name, argv, self.log_dir / f"{name}.log", env, cpus, kind=kind,
                             address=address, ready_pattern=ready_pattern,
                             unset_env=(cluster_secret.ENV, cluster_secret.ENV_FILE))
        child.start()
        self.children.append(child)
        self.write_state()
        return child

    def _py(self, module: str, *args: str) -> list[str]:
        return [self.spec.python, "-m", module, *args]

    def _etcd_ports(self) -> tuple[str, int, int]:
        """Where etcd listens: (address, client port, peer port)."""
        return "127.0.0.1", free_port(), free_port()

    def _start_etcd(self) -> None:
        etcd = shutil.which("etcd") or "/usr/bin/etcd"
        addr, client_port, peer_port = self._etcd_ports()
        tls = self.spec.tls
        url = f"{'https' if tls else 'http'}://{addr}:{client_port}"
        peer = f"http://{addr}:{peer_port}"   # one member: no peer traffic
        assert self._tmp is not None
        tls_args = ["--cert-file", tls.cert, "--key-file", tls.key, "--trusted-ca-file", tls.ca,
                    "--client-cert-auth"] if tls else []
        child = self._spawn("etcd", "etcd", [
            etcd, "--name", "kvlocal", "--data-dir", str(Path(self._tmp) / "etcd-data"),
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kvlocal={peer}", *tls_args, "--logger", "zap",
            "--log-level", "warn"], url)
        self._wait(child, lambda: self.is_ready(child))
        self.etcd_url = url
        self.on_status(f"etcd ready at {url}")

    def _start_store(self) -> None:
        spec = self.spec
        port = free_port()
        child = self._spawn("store", "store", self._py(
            "kvstore.daemon.cli", "serve", "--port", str(port), "--memory", spec.store_memory,
            "--etcd", self._etcd(), "--cluster", spec.cluster, *spec.store_args), f"127.0.0.1:{port}",
            ready_pattern=rf"^kvstore ready address=\S*:{port} node_id=(?P<id>\S+)")
        self._wait(child, lambda: self.is_ready(child))
        self.on_status(f"store ready on 127.0.0.1:{port} ({spec.store_memory} host memory, "
                       f"node_id {child.member_id})")

    def _spawn_worker(self, name: str, role: str) -> ChildProcess:
        if self.spec.engine == "vllm":
            return self._spawn_vllm(name, role)
        spec = self.spec
        port = free_port()
        threads = str(spec.threads_per_worker)
        cpus_text = {"prefill": spec.prefill_cpus, "decode": spec.decode_cpus,
                     "colocated": spec.colocated_cpus}[role]
        cpus = parse_cpus(cpus_text) if cpus_text else None
        url = f"{'https' if spec.tls else 'http'}://127.0.0.1:{port}"
        child = self._spawn(name, role, self._py(
            "engine.worker.cli", "serve", "--role", role, "--model", str(self.model_dir),
            "--port", str(port), "--etcd", self._etcd(), "--cluster", spec.cluster,
            "--threads", threads, *spec.worker_args), url,
            env={"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                 "TOKENIZERS_PARALLELISM": "false"}, cpus=cpus,
            ready_pattern=rf"^kvengine ready address={re.escape(url)} worker_id=(?P<id>\S+)")
        if cpus:
            self.on_status(f"{name}: {threads} thread(s) pinned to CPUs {sorted(cpus)}")
        return child

    def _spawn_vllm(self, name: str, role: str) -> ChildProcess:
        """A vLLM OpenAI server with the store's connector (``router.cluster.vllm_worker``)."""
        spec = self.spec
        assert self.model_dir is not None and self._tmp is not None
        w = VllmWorker(name, role, free_port(), self.model_dir, self._etcd(), spec.cluster, self._tmp,
                       python=spec.vllm_python, block_size=spec.vllm_block_size,
                       kv_cache_bytes=parse_size(spec.vllm_kv_cache), threads=spec.threads_per_worker,
                       extra_args=spec.worker_args)
        argv, env = w.command()
        cpus_text = {"prefill": spec.prefill_cpus, "decode": spec.decode_cpus,
                     "colocated": spec.colocated_cpus}[role]
        return self._spawn(name, role, argv, w.url, env=env, cpus=parse_cpus(cpus_text) if cpus_text else None,
                           ready_pattern=w.ready_pattern)

    def start_router(self, *, name: str = "router", port: int | None = None,
                     mode: str | None = None, policy: str | None = None,
                     auto_threshold: int | None = None, cluster: str | None = None,
                     request_log: str | None = None, api_key: str | None = None,
                     expect_workers: int = 1) -> str:
        """Start a router (the cluster's, or another one on the same etcd) and return its URL
        once it logged that it serves on its port, ``/health`` answers and it sees
        ``expect_workers`` workers (0: just answering). A port that is taken is a
        ``LaunchError`` before the router starts."""
        spec = self.spec
        port = port if port is not None else (spec.port or free_port(spec.host))
        if self._router_port_taken(port):
            raise LaunchError(f"{name}: port {port} on {self.router_host} is already in use (another process "
                              "listens there); stop it or choose another port")
        auto_threshold = auto_threshold if auto_threshold is not None else spec.auto_threshold
        request_log = request_log or spec.request_log
        argv = self._py("router.cli", "serve", "--etcd", self._etcd(),
                        "--cluster", cluster or spec.cluster, "--host", self.router_host,
                        "--port", str(port), "--mode", mode or spec.mode,
                        "--policy", policy or spec.policy, "--model", str(self.model_dir))
        if auto_threshold is not None:
            argv += ["--auto-threshold", str(auto_threshold)]
        if request_log:
            argv += ["--request-log", request_log]
        argv += list(spec.router_args)
        env = {"TOKENIZERS_PARALLELISM": "false"}
        api_key = api_key or spec.api_key
        if api_key:
            env["KVROUTER_API_KEY"] = api_key        # not on the command line (ps shows argv)
        url = f"http://{self.router_host}:{port}"
        child = self._spawn(name, "router", argv, url, env=env,
                            ready_pattern=rf"serving on http://\S*:{port}\b")

        def ready() -> bool:
            if not self.is_ready(child):
                return False
            if expect_workers == 0:
                return True
            resp = self._http.get(f"{url}/health")
            return resp.status_code == 200 and int(resp.json().get("workers", 0)) >= expect_workers
        self._wait(child, ready)
        if name == "router":
            self.router_url = url
            self.write_state()
        self.on_status(f"{name} ready at {url} ({mode or spec.mode}, "
                       f"{expect_workers} worker(s))")
        return url

    # -- helpers -----------------------------------------------------------------------
    def _router_port_taken(self, port: int) -> bool:
        return port_taken(self.router_host, port)

    def _etcd(self) -> str:
        assert self.etcd_url is not None
        return self.etcd_url

    def registered(self, kind: layout.Kind) -> set[str]:
        """The ids of ``kind`` (``stores``, ``workers``) registered in the cluster now."""
        if self._etcd_client is None:
            self._etcd_client = EtcdClient(self._etcd(), tls=self.spec.tls or False)
        prefix = layout.prefix(self.spec.cluster, kind)
        members, _revision = self._etcd_client.get_prefix(prefix)
        return {k[len(prefix):].strip("/") for k in members}

    def _wait(self, child: ChildProcess, ready: Callable[[], bool]) -> None:
        """Poll ``ready`` until true; fail if ``child`` exits or the deadline passes."""
        deadline = time.monotonic() + self.spec.ready_timeout
        delay = 0.05
        while True:
            if not child.alive():
                code = child.proc.returncode if child.proc is not None else None
                raise LaunchError(f"{child.name} exited with code {code} while "
                                  f"starting; last lines of {child.log_path}:\n{child.log_tail()}")
            try:
                if ready():
                    return
            except (httpx.HTTPError, KVStoreError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise LaunchError(f"{child.name} not ready after {self.spec.ready_timeout:.0f} s; "
                                  f"last lines of {child.log_path}:\n{child.log_tail()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
