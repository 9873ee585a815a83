"""Real vLLM OpenAI-compatible servers (``.venv-vllm``, vLLM's CPU backend) for the tests of
this package, started once per session because each start costs about a minute here.

- ``vllm_pd`` (session): one store daemon and two vLLM servers on the default model, both with
  the store as their KV connector: ``producer`` (``kv_role="kv_producer"``, a prefill instance)
  and ``consumer`` (``"kv_consumer"``, a decode instance). They start in parallel, are waited
  for on ``/health`` with a deadline and warmed up with one short request; at the end of the
  session every process group is stopped (SIGTERM, then SIGKILL), so no vLLM process, engine
  core or daemon is left behind. Skipped,
  naming what is missing, where ``.venv-vllm/bin/python`` is absent
  (``bash scripts/setup_vllm.sh`` builds it).

The servers require the cluster secret as their API key (``Authorization: Bearer``, on ``/v1``
only: ``/health`` and ``/metrics`` are open), report cached prompt tokens in ``usage`` and
per-request timings (``--enable-prompt-tokens-details``, ``--enable-per-request-metrics``),
and publish their KV cache events over ZMQ (``VllmServer.kv_events`` and ``kv_replay``).
``VllmServer.prompt_tokens_by_source()`` reads vLLM's own counters of where prompt tokens came
from (``local_compute``, ``local_cache_hit``, ``external_kv_transfer``).

Every command that starts vLLM should run under ``flock /tmp/vllm-heavy.lock`` on a shared
machine (``pytest`` itself, e.g. ``flock /tmp/vllm-heavy.lock .venv/bin/python -m pytest ...``).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstore.keys import BlockKey
from engine.api.generate import WorkerInfo, WorkerRole
from tests.kvstore.conftest import DaemonFactory, DaemonProc

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_SECRET = "vllm-serve-test-secret"
VLLM_BLOCK = 32
VLLM_MAX_MODEL_LEN = 4096
VLLM_KV_BYTES = 1 << 30
VLLM_START_TIMEOUT = 420.0  # both start at once on a small machine; one alone takes ~60 s
_PR_SET_PDEATHSIG = 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_pytest(parent: int):
    """In the child: SIGKILL when pytest dies (set from the main thread only: the kernel ties
    the signal to the forking thread)."""
    def preexec() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)
    return preexec


@dataclass
class VllmServer:
    """One vLLM API server (``python -m vllm.entrypoints.openai.api_server``) in its own
    process group; its output in ``log``."""

    role: str                 # the connector's kv_role: "kv_producer", "kv_consumer", "kv_both"
    url: str                  # "http://127.0.0.1:PORT"
    proc: subprocess.Popen
    log: Path
    kv_events: str            # ZMQ PUB endpoint (ipc://) of its KV cache events
    kv_replay: str            # ZMQ ROUTER endpoint (ipc://) replaying them
    _log_file: Any = field(default=None, repr=False)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_healthy(self, deadline: float) -> None:
        """Wait until ``GET /health`` answers 200; fail with the log's tail if the process
        exits or ``deadline`` (a ``time.monotonic()``) passes."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM ({self.role}) exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM ({self.role}) not healthy in time:\n{self.log_tail()}")

    def warm_up(self, model: str, api_key: str | None) -> None:
        """One short request: vLLM's first one pays for its lazy set-up (seconds here)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        resp = httpx.post(self.url + "/v1/completions", headers=headers, timeout=300.0,
                          json={"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 2,
                                "temperature": 0.0})
        if resp.status_code != 200:
            raise RuntimeError(f"vLLM ({self.role}) failed its warm-up: HTTP {resp.status_code} "
                               f"{resp.text[:500]}\n{self.log_tail()}")

    def metrics(self) -> str:
        """``GET /metrics`` (Prometheus text)."""
        resp = httpx.get(self.url + "/metrics", timeout=10.0)
        resp.raise_for_status()
        return resp.text

    def metric(self, name: str) -> float:
        """The sum of every series of the metric ``name`` (e.g. ``vllm:num_requests_running``)."""
        pattern = re.compile(rf'^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)', re.M)
        return sum(float(v) for v in pattern.findall(self.metrics()))

    def prompt_tokens_by_source(self) -> dict[str, float]:
        """``vllm:prompt_tokens_by_source`` by its ``source`` label (``local_compute``,
        ``local_cache_hit``, ``external_kv_transfer``), summed over other labels."""
        out: dict[str, float] = {}
        pattern = re.compile(r'^vllm:prompt_tokens_by_source(?:_total)?\{([^}]*)\}\s+(\S+)', re.M)
        for labels, value in pattern.findall(self.metrics()):
            source = re.search(r'source="([^"]*)"', labels)
            if source:
                out[source.group(1)] = out.get(source.group(1), 0.0) + float(value)
        return out

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM its process group, SIGKILL what is left after ``timeout`` seconds."""
        _stop_group(self.proc, timeout)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _stop_group(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM the server alone first (it shuts its engine core down and frees its shared
    memory), then what is left of its process group: SIGTERM, and SIGKILL after 5 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break   # the group is empty
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _group_alive(proc.pid):
            time.sleep(0.1)
    if proc.poll() is None:
        proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def start_vllm(log: Path, model_dir: Path, served_name: str, *, kv_role: str | None,
               daemon_address: str | None = None, secret_file: Path | None = None,
               api_key: str | None = VLLM_SECRET, extra_args: tuple[str, ...] = ()) -> VllmServer:
    """Start one vLLM server on free ports (not waiting for it: see ``wait_healthy``). With
    ``kv_role``, the store (``daemon_address``, ``secret_file``) is its KV connector."""
    port = _free_port()
    # ipc endpoints: vLLM binds them (a tcp://host:port endpoint it would connect to instead).
    events, replay = f"ipc://{log.with_suffix('.events')}", f"ipc://{log.with_suffix('.replay')}"
    args = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", served_name,
            "--dtype", "float32", "--block-size", str(VLLM_BLOCK),
            "--max-model-len", str(VLLM_MAX_MODEL_LEN), "--enforce-eager",
            "--kv-cache-memory-bytes", str(VLLM_KV_BYTES), "--max-num-seqs", "8", "--seed", "0",
            "--host", "127.0.0.1", "--port", str(port),
            "--enable-prompt-tokens-details", "--enable-per-request-metrics",
            "--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": events, "replay_endpoint": replay})]
    if api_key:
        args += ["--api-key", api_key]
    if kv_role is not None:
        extra = {"address": daemon_address, "secret_file": str(secret_file), "timeout": 2.0,
                 "handoff_wait_s": 30.0}
        args += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm.connector",
            "kv_role": kv_role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra})]
    args += list(extra_args)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_LOGGING_LEVEL": "WARNING"}
    for name in ("KVSTORE_AUTH_TOKEN", "KVCACHE_CLUSTER_SECRET", "KVCACHE_CLUSTER_SECRET_FILE"):
        env.pop(name, None)
    log.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log, "wb")
    main = threading.current_thread() is threading.main_thread()
    # Its own session and process group: it and its engine core stop together (``stop``).
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log_file,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_die_with_pytest(os.getpid()) if main else None)
    return VllmServer(kv_role or "none", f"http://127.0.0.1:{port}", proc, log, events, replay,
                      log_file)


@dataclass
class VllmPD:
    """What ``vllm_pd`` yields: a prefill (``producer``) and a decode (``consumer``) vLLM
    server sharing one store ``daemon`` through the connector."""

    producer: VllmServer
    consumer: VllmServer
    model: str                # the served model name (``WorkerInfo.model``)
    model_dir: Path
    daemon: DaemonProc
    secret: str               # the servers' API key, also the daemon's cluster secret
    secret_file: Path
    block_size: int = VLLM_BLOCK
    max_model_len: int = VLLM_MAX_MODEL_LEN

    @property
    def daemon_address(self) -> str:
        return self.daemon.address

    @property
    def headers(self) -> dict[str, str]:
        """What the router sends every worker: ``Authorization: Bearer <secret>``."""
        return {"Authorization": f"Bearer {self.secret}"}

    def worker_info(self, server: VllmServer, worker_id: str | None = None,
                    role: WorkerRole | None = None,
                    namespace: BlockKey = BlockKey(bytes(16))) -> WorkerInfo:
        """A registration for ``server`` as the router would hold it."""
        if role is None:
            role = "prefill" if server.role == "kv_producer" else (
                "decode" if server.role == "kv_consumer" else "colocated")
        return WorkerInfo(worker_id or f"vllm-{server.role}-{server.port}", server.url, role,
                          self.model, namespace, self.block_size, self.kv_capacity_blocks,
                          self.max_model_len)

    @property
    def kv_capacity_blocks(self) -> int:
        """The blocks ``--kv-cache-memory-bytes`` holds (float32 keys and values, every layer)."""
        cfg = json.loads((self.model_dir / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        block_bytes = (cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim
                       * self.block_size * 4)
        return VLLM_KV_BYTES // block_bytes

    def tokenizer(self) -> Any:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def vllm_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmPD]:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"the vLLM environment is not built ({VLLM_PYTHON} is absent): "
                    "bash scripts/setup_vllm.sh")
    from engine.model.convert import ensure_default_model

    model_dir = ensure_default_model(progress=False)
    base = tmp_path_factory.mktemp("vllm-pd")
    secret_file = base / "secret"
    secret_file.write_text(VLLM_SECRET)
    factory = DaemonFactory(base / "daemons")
    servers: list[VllmServer] = []
    try:
        daemon = factory(memory="1G", env={"KVCACHE_CLUSTER_SECRET": VLLM_SECRET})
        for role in ("kv_producer", "kv_consumer"):
            servers.append(start_vllm(base / f"{role}.log", model_dir, model_dir.name,
                                      kv_role=role, daemon_address=daemon.address,
                                      secret_file=secret_file))
        deadline = time.monotonic() + VLLM_START_TIMEOUT

        def ready(server: VllmServer) -> None:
            server.wait_healthy(deadline)
            server.warm_up(model_dir.name, VLLM_SECRET)

        with ThreadPoolExecutor(len(servers)) as pool:
            for f in [pool.submit(ready, s) for s in servers]:
                f.result()
        yield VllmPD(servers[0], servers[1], model_dir.name, model_dir, daemon, VLLM_SECRET,
                     secret_file)
    finally:
        for s in servers:
            s.stop()
        factory.close()
