"""The vLLM cluster of this package's tests, as its tests see it: ``VllmServer`` (one vLLM
OpenAI server of the cluster: its URL, log, worker id, KV event endpoints, metrics) and
``VllmPD`` (what the ``vllm_pd`` fixture of this package's conftest.py yields: a prefill and a
decode server sharing one store, and the router in front), ``registered`` (a worker's
registration in etcd, as its connector wrote it), and the settings the cluster runs with
(``VLLM_PYTHON``, ``VLLM_BLOCK``, ``VLLM_MAX_MODEL_LEN``, ...).

The servers require the cluster secret as their API key (``Authorization: Bearer``, on ``/v1``
only: ``/health`` and ``/metrics`` are open), report cached prompt tokens in ``usage`` and
per-request timings, and publish their KV cache events over ZMQ on unix sockets
(``VllmServer.kv_events`` and ``kv_replay``, from their registrations).
``VllmServer.prompt_tokens_by_source()`` reads vLLM's own counters of where prompt tokens came
from (``local_compute``, ``local_cache_hit``, ``external_kv_transfer``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from engine.api.generate import WorkerInfo, WorkerRole
from router.cluster.launcher import LocalCluster

__all__ = ["ROOT", "VLLM_PYTHON", "VLLM_BLOCK", "VLLM_MAX_MODEL_LEN", "VLLM_KV_BYTES", "VLLM_THREADS",
           "VLLM_START_TIMEOUT", "VllmServer", "VllmPD", "registered"]

ROOT = Path(__file__).resolve().parents[2]    # the repository
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_BLOCK = 32
VLLM_MAX_MODEL_LEN = 4096
VLLM_KV_BYTES = 1 << 30
VLLM_THREADS = 1
VLLM_START_TIMEOUT = 420.0  # both start at once on a small machine; one alone takes ~60 s


@dataclass
class VllmServer:
    """One vLLM API server of the cluster (``kvstore.integrations.vllm.serve``); its output in
    ``log``."""

    role: str                 # the connector's kv_role: "kv_producer", "kv_consumer", "kv_both"
    url: str                  # "http://127.0.0.1:PORT"
    log: Path
    worker_id: str
    kv_events: str            # ZMQ PUB endpoint (ipc://) of its KV cache events
    kv_replay: str            # ZMQ ROUTER endpoint (ipc://) replaying them

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

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


@dataclass
class VllmPD:
    """What ``vllm_pd`` yields: a prefill (``producer``) and a decode (``consumer``) vLLM
    server sharing one store through the connector, and the router in front of both."""

    producer: VllmServer
    consumer: VllmServer
    model: str                # the served model name (``WorkerInfo.model``)
    model_dir: Path
    cluster: LocalCluster
    secret: str               # the servers' API key: the cluster secret
    block_size: int = VLLM_BLOCK
    max_model_len: int = VLLM_MAX_MODEL_LEN

    @property
    def router_url(self) -> str:
        assert self.cluster.router_url is not None
        return self.cluster.router_url

    @property
    def daemon_address(self) -> str:
        return self.cluster.child("store").address

    @property
    def secret_file(self) -> Path:
        assert self.cluster.secret_file is not None
        return self.cluster.secret_file

    @property
    def headers(self) -> dict[str, str]:
        """What the router sends every worker: ``Authorization: Bearer <secret>``."""
        return {"Authorization": f"Bearer {self.secret}"}

    def registration(self, server: VllmServer) -> WorkerInfo:
        """``server``'s registration in etcd, as its connector wrote it."""
        return registered(self.cluster, server.worker_id)

    def worker_info(self, server: VllmServer, worker_id: str | None = None,
                    role: WorkerRole | None = None) -> WorkerInfo:
        """``server``'s registration as the router holds it (another id or role if given)."""
        info = self.registration(server)
        return dataclasses.replace(info, worker_id=worker_id or info.worker_id, role=role or info.role)

    @property
    def kv_capacity_blocks(self) -> int:
        return self.registration(self.producer).kv_capacity_blocks

    def tokenizer(self) -> Any:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))


def registered(cluster: LocalCluster, worker_id: str) -> WorkerInfo:
    from kvstore.coord.etcd import EtcdClient
    from kvstore.coord.layout import worker_key

    assert cluster.etcd_url is not None
    client = EtcdClient(cluster.etcd_url)
    try:
        raw = client.get(worker_key(cluster.spec.cluster, worker_id))
    finally:
        client.close()
    assert raw is not None, f"{worker_id} is not registered"
    return WorkerInfo.from_etcd_value(worker_id, json.loads(raw))
