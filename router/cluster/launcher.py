"""The local cluster: etcd, a store daemon, prefill and decode workers and the router as children.

``LocalCluster(spec).start()`` brings the parts up in dependency order and waits for each to
be ready before the next one starts (etcd answers ``/health``; the store and every worker are
registered in etcd; the router answers ``/health`` and sees every worker). ``stop()`` (or
leaving the ``with`` block) ends them in reverse order. Guarantees:

- Every child runs in its own session (process group): stopping a child signals its whole
  group (SIGTERM, then SIGKILL after ``stop_timeout``), so nothing a child started survives.
- Every child also gets ``PR_SET_PDEATHSIG = SIGTERM``: if the launcher itself is killed
  (even with SIGKILL) its direct children are told to stop; no orphans.
- A child that exits while the cluster comes up fails ``start()`` with ``LaunchError``
  naming the child and quoting the tail of its log.
- Nothing process-wide happens in the constructor; signal handling belongs to the CLI.

Children's output goes to ``{log_dir}/{name}.log`` (a temporary directory by default).
Threads per worker are set explicitly (``--threads`` and ``OMP_NUM_THREADS``); each role's
workers may be pinned to a CPU set (``prefill_cpus``, ``decode_cpus``, ``colocated_cpus``:
``"0"``, ``"0,1"``, ``"0-3"``), applied in the child before exec.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvstore.errors import KVStoreError
from kvstore.coord import layout
from kvstore.coord.etcd import EtcdClient

__all__ = ["ClusterSpec", "LocalCluster", "ChildProcess", "LaunchError", "free_port",
           "resolve_model_dir", "parse_cpus", "DEFAULT_MODEL_NAME"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """A part of the local cluster did not come up; the message says which and why."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list as ``taskset -c`` takes it (``"0"``, ``"0,2"``, ``"0-3"``) -> CPU ids."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"not a CPU list: {text!r} (want e.g. 0 or 0,1 or 0-3)") from None
    if not cpus or min(cpus) < 0:
        raise ValueError(f"not a CPU list: {text!r} (want e.g. 0 or 0,1 or 0-3)")
    return frozenset(cpus)


def resolve_model_dir(model: str) -> Path:
    """``"default"`` -> the converted default checkpoint in the cache; otherwise the directory.

    Raises ``LaunchError`` with the command that fixes it when the directory is not a
    checkpoint (no ``config.json``).
    """
    if model == "default":
        try:
            from engine.api.paths import default_model_dir  # torch-free path helper
            path = Path(default_model_dir())
        except ImportError:
            cache = Path(os.environ.get("KVCACHE_STORE_CACHE", "~/.cache/kvcache-store")).expanduser()
            path = cache / "models" / DEFAULT_MODEL_NAME
        if not (path / "config.json").is_file():
            raise LaunchError(
                f"the default model is not converted yet ({path} has no config.json); "
                "run `bash scripts/setup.sh` or `python -m engine.model.convert --default` first")
        return path
    path = Path(model).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise LaunchError(f"--model {model!r} is not a checkpoint directory (no config.json)")
    return path


@dataclass(frozen=True)
class ClusterSpec:
    """What ``kvrouter up`` runs. ``port=0`` picks a free port for the router."""

    port: int = 8000
    host: str = "127.0.0.1"
    prefill: int = 1
    decode: int = 1
    mode: str = "disaggregated"          # disaggregated | colocated | auto
    policy: str = "kv-aware"
    auto_threshold: int | None = None
    model: str = "default"
    etcd: str | None = None              # an existing etcd; None starts one as a child
    cluster: str = "kvlocal"
    threads_per_worker: int = 1
    store_memory: str = "512M"
    api_key: str | None = None
    request_log: str | None = None
    log_dir: str | None = None
    ready_timeout: float = 180.0
    stop_timeout: float = 10.0
    worker_args: tuple[str, ...] = ()    # extra flags for every `kvengine serve`
    prefill_cpus: str | None = None      # CPU list each role's workers are pinned to
    decode_cpus: str | None = None       # (None: not pinned)
    colocated_cpus: str | None = None
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated", "auto"):
            raise ValueError(f"mode must be disaggregated, colocated or auto, got {self.mode!r}")
        for cpus in (self.prefill_cpus, self.decode_cpus, self.colocated_cpus):
            if cpus is not None:
                parse_cpus(cpus)
        if self.mode == "colocated":
            return
        if self.prefill < (1 if self.mode == "disaggregated" else 0) or self.decode < 1:
            raise ValueError(f"{self.mode} mode needs at least one decode worker"
                             + (" and one prefill worker" if self.mode == "disaggregated" else ""))
        if self.threads_per_worker < 1:
            raise ValueError("threads_per_worker must be >= 1")


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _child_setup(cpus: frozenset[int] | None) -> Callable[[], None]:
    def setup() -> None:  # between fork and exec
        _set_pdeathsig()
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup


@dataclass
class ChildProcess:
    """One child in its own process group, its output in ``log_path``."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cpus: frozenset[int] | None = None   # pinned to these CPUs (None: not pinned)
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, start_new_session=True, preexec_fn=_child_setup(self.cpus))

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n_bytes: int = 2000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n_bytes:].decode("utf-8", "replace")

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)   # start_new_session: pgid == pid
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the group, wait up to ``timeout``, then SIGKILL it. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.proc.wait()
        # Anything left in the group (a grandchild that ignored SIGTERM) goes too.
        self.signal_group(signal.SIGKILL)
        return self.proc.returncode


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
        self._tmp: str | None = None
        self.log_dir: Path | None = None
        self._http = httpx.Client(timeout=2.0, trust_env=False)
        self._etcd_client: EtcdClient | None = None

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
        self.model_dir = resolve_model_dir(spec.model)
        self._tmp = tempfile.mkdtemp(prefix="kvrouter-up-")
        self.log_dir = Path(spec.log_dir) if spec.log_dir else Path(self._tmp) / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.on_status(f"logs in {self.log_dir}")
        if self.etcd_url is None:
            self._start_etcd()
        self._start_store()
        roles = (["colocated"] if spec.mode == "colocated"
                 else ["prefill"] * spec.prefill + ["decode"] * spec.decode)
        counts: dict[str, int] = {}
        before = self._registered("workers")
        started = []
        for role in roles:   # all at once: their start-up (imports, model load) overlaps
            counts[role] = counts.get(role, 0) + 1
            started.append(self._spawn_worker(f"{role}-{counts[role] - 1}", role))
        for child, role, url in started:
            self._wait(child, lambda u=url: self._http.get(f"{u}/health").status_code == 200)
            self.worker_urls[child.name] = url
            self.on_status(f"{role} worker {child.name} ready at {url}")
        self._wait(started[-1][0], lambda: self._registered("workers") >= before + len(roles))
        self.router_url = self.start_router(expect_workers=len(roles))

    def child(self, name: str) -> ChildProcess:
        """The child called ``name`` (``etcd``, ``store``, ``prefill-0``, ``router``...)."""
        for c in self.children:
            if c.name == name:
                return c
        raise KeyError(f"no child named {name!r}; have {[c.name for c in self.children]}")

    def stop(self) -> None:
        """Stop every child, the last started first; idempotent."""
        for child in reversed(self.children):
            if child.proc is not None and child.proc.returncode is None:
                code = child.stop(self.spec.stop_timeout)
                self.on_status(f"stopped {child.name} (exit {code})")
        self.children.clear()
        self._http.close()
        if self._etcd_client is not None:
            self._etcd_client.close()
            self._etcd_client = None
        if self._tmp is not None:
            logs_inside = self.log_dir is not None and Path(self._tmp) in self.log_dir.parents
            data = Path(self._tmp) / "etcd-data"
            shutil.rmtree(data if logs_inside else self._tmp, ignore_errors=True)

    def failed_children(self) -> list[ChildProcess]:
        """Children that have exited (for a supervisor loop)."""
        return [c for c in self.children if c.proc is not None and c.proc.poll() is not None]

    # -- parts -------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
               cpus: frozenset[int] | None = None) -> ChildProcess:
        assert self.log_dir is not None
        child = ChildProcess(name, argv, self.log_dir / f"{name}.log", env or {}, cpus)
        child.start()
        self.children.append(child)
        return child

    def _py(self, module: str, *args: str) -> list[str]:
        return [self.spec.python, "-m", module, *args]

    def _start_etcd(self) -> None:
        etcd = shutil.which("etcd") or "/usr/bin/etcd"
        client_port, peer_port = free_port(), free_port()
        url, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
        assert self._tmp is not None
        child = self._spawn("etcd", [
            etcd, "--name", "kvlocal", "--data-dir", str(Path(self._tmp) / "etcd-data"),
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kvlocal={peer}", "--logger", "zap", "--log-level", "warn"])
        self._wait(child, lambda: self._http.get(f"{url}/health").json().get("health") == "true")
        self.etcd_url = url
        self.on_status(f"etcd ready at {url}")

    def _start_store(self) -> None:
        spec = self.spec
        port = free_port()
        child = self._spawn("store", self._py(
            "kvstore.daemon.cli", "serve", "--port", str(port), "--memory", spec.store_memory,
            "--etcd", self._etcd(), "--cluster", spec.cluster))
        self._wait(child, lambda: self._registered("stores") >= 1)
        self.on_status(f"store ready on 127.0.0.1:{port} ({spec.store_memory} host memory)")

    def _spawn_worker(self, name: str, role: str) -> tuple[ChildProcess, str, str]:
        spec = self.spec
        port = free_port()
        threads = str(spec.threads_per_worker)
        cpus_text = {"prefill": spec.prefill_cpus, "decode": spec.decode_cpus,
                     "colocated": spec.colocated_cpus}[role]
        cpus = parse_cpus(cpus_text) if cpus_text else None
        child = self._spawn(name, self._py(
            "engine.worker.cli", "serve", "--role", role, "--model", str(self.model_dir),
            "--port", str(port), "--etcd", self._etcd(), "--cluster", spec.cluster,
            "--threads", threads, *spec.worker_args),
            env={"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                 "TOKENIZERS_PARALLELISM": "false"}, cpus=cpus)
        if cpus:
            self.on_status(f"{name}: {threads} thread(s) pinned to CPUs {sorted(cpus)}")
        return child, role, f"http://127.0.0.1:{port}"

    def start_router(self, *, name: str = "router", port: int | None = None,
                     mode: str | None = None, policy: str | None = None,
                     auto_threshold: int | None = None, cluster: str | None = None,
                     request_log: str | None = None, api_key: str | None = None,
                     expect_workers: int = 1) -> str:
        """Start a router (the cluster's, or another one on the same etcd) and return its URL
        once ``/health`` answers and it sees ``expect_workers`` workers (0: just answering)."""
        spec = self.spec
        port = port if port is not None else (spec.port or free_port(spec.host))
        auto_threshold = auto_threshold if auto_threshold is not None else spec.auto_threshold
        request_log = request_log or spec.request_log
        argv = self._py("router.cli", "serve", "--etcd", self._etcd(),
                        "--cluster", cluster or spec.cluster, "--host", spec.host,
                        "--port", str(port), "--mode", mode or spec.mode,
                        "--policy", policy or spec.policy, "--model", str(self.model_dir))
        if auto_threshold is not None:
            argv += ["--auto-threshold", str(auto_threshold)]
        if request_log:
            argv += ["--request-log", request_log]
        env = {"TOKENIZERS_PARALLELISM": "false"}
        api_key = api_key or spec.api_key
        if api_key:
            env["KVROUTER_API_KEY"] = api_key        # not on the command line (ps shows argv)
        child = self._spawn(name, argv, env)
        url = f"http://{spec.host}:{port}"

        def ready() -> bool:
            resp = self._http.get(f"{url}/health")
            if expect_workers == 0:
                return resp.status_code in (200, 503)
            return resp.status_code == 200 and int(resp.json().get("workers", 0)) >= expect_workers
        self._wait(child, ready)
        self.on_status(f"{name} ready at {url} ({mode or spec.mode}, "
                       f"{expect_workers} worker(s))")
        return url

    # -- helpers -----------------------------------------------------------------------
    def _etcd(self) -> str:
        assert self.etcd_url is not None
        return self.etcd_url

    def _registered(self, kind: layout.Kind) -> int:
        """How many ``kind`` (``stores``, ``workers``) are registered in the cluster now."""
        if self._etcd_client is None:
            self._etcd_client = EtcdClient(self._etcd())
        members, _revision = self._etcd_client.get_prefix(layout.prefix(self.spec.cluster, kind))
        return len(members)

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
