"""How ``kvrouter up --engine vllm`` runs a worker: a vLLM OpenAI server with the store's KV
connector (``kvstore.integrations.vllm``), in the Python that holds vLLM.

``VllmWorker.command`` is the child's command line and environment: ``python -m
kvstore.integrations.vllm.serve`` (vLLM's server, the cluster secret its API key) on the
cluster's model in float32, the connector in the role's ``kv_role`` (prefill: ``kv_producer``,
decode: ``kv_consumer``, colocated: ``kv_both``) finding the store through etcd and
registering the instance there under ``worker_id`` once it serves, and vLLM's KV events on unix
sockets in the cluster's private directory (they carry prompts' token ids; vLLM binds
``ipc://`` endpoints, where it would connect to a ``tcp://host:port`` one). The child's ready
line is the connector's ``kvstore-vllm ready address=URL worker_id=ID`` (``ready_pattern``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["VllmWorker", "default_vllm_python"]

KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "colocated": "kv_both"}


def default_vllm_python() -> Path:
    """The repository's ``.venv-vllm`` (``scripts/setup_vllm.sh``), where ``--engine vllm`` runs."""
    return Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


@dataclass(frozen=True)
class VllmWorker:
    name: str
    role: str
    port: int
    model_dir: Path
    etcd: str
    cluster: str
    private_dir: str             # the cluster's 0700 directory: the event sockets live there
    python: str = ""
    block_size: int = 32
    kv_cache_bytes: int = 1 << 30
    threads: int = 1
    extra_args: tuple[str, ...] = ()
    worker_id: str = ""

    def __post_init__(self) -> None:
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{self.name}-{os.urandom(4).hex()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ready_pattern(self) -> str:
        return rf"kvstore-vllm ready address={re.escape(self.url)} worker_id=(?P<id>\S+)"

    def command(self) -> tuple[list[str], dict[str, str]]:
        """(argv, extra environment) of the child."""
        events, replay = (f"ipc://{self.private_dir}/{self.worker_id}.{what}" for what in ("events", "replay"))
        connector = {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm.connector",
            "kv_role": KV_ROLES[self.role], "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "etcd": self.etcd, "cluster": self.cluster,
                "register": {"etcd": self.etcd, "cluster": self.cluster, "url": self.url, "role": self.role,
                             "worker_id": self.worker_id, "kv_events": events, "kv_events_replay": replay}}}
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": events, "replay_endpoint": replay}
        argv = [self.python or str(default_vllm_python()), "-m", "kvstore.integrations.vllm.serve",
                "--model", str(self.model_dir), "--served-model-name", self.model_dir.name,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                "--block-size", str(self.block_size), "--enforce-eager",
                "--enable-prompt-tokens-details", "--enable-per-request-metrics",
                "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
                "--kv-transfer-config", json.dumps(connector), "--kv-events-config", json.dumps(kv_events),
                *self.extra_args]
        threads = str(self.threads)
        env = {"OMP_NUM_THREADS": threads, "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}
        return argv, env
