"""A real vLLM cluster for the tests of this package: ``kvrouter up --engine vllm``'s
``LocalCluster`` (etcd, one store daemon, a prefill and a decode vLLM OpenAI server with the
store's KV connector, and the router in front), started once for this package's tests because
each vLLM start costs about a minute here, and stopped when they are done (idle vLLM servers
would otherwise share the CPUs with every later test).

- ``vllm_pd`` (package): the cluster on the default model: ``producer`` (the prefill instance,
  ``kv_role="kv_producer"``) and ``consumer`` (the decode instance, ``"kv_consumer"``), each
  registered in etcd by its connector once it served (the cluster waits for their ready
  lines), warmed up with one short request, and the router (``router_url``) seeing both. After
  the package's last test the cluster stops every child's process group. Skipped, naming what
  is missing, where ``.venv-vllm/bin/python`` is absent (``bash scripts/setup_vllm.sh``).

What it yields (``VllmPD``, ``VllmServer``), ``registered`` and the cluster's settings are in
tests/integrations/vllm_procs.py, which the tests import.

Every command that starts vLLM should run under ``flock /tmp/vllm-heavy.lock`` on a shared
machine (``pytest`` itself, e.g. ``flock /tmp/vllm-heavy.lock .venv/bin/python -m pytest ...``).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from router.cluster.launcher import ClusterSpec, LocalCluster
from tests.integrations.vllm_procs import (
    VLLM_BLOCK,
    VLLM_KV_BYTES,
    VLLM_MAX_MODEL_LEN,
    VLLM_PYTHON,
    VLLM_START_TIMEOUT,
    VLLM_THREADS,
    VllmPD,
    VllmServer,
    registered,
)


@pytest.fixture(scope="package")
def vllm_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmPD]:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"the vLLM environment is not built ({VLLM_PYTHON} is absent): "
                    "bash scripts/setup_vllm.sh")
    from engine.model.convert import ensure_default_model

    model_dir = ensure_default_model(progress=False)
    base = tmp_path_factory.mktemp("vllm-pd")
    spec = ClusterSpec(port=0, prefill=1, decode=1, mode="disaggregated", model=str(model_dir),
                       cluster="vllmtest", store_memory="1G", log_dir=str(base / "logs"),
                       threads_per_worker=VLLM_THREADS,
                       ready_timeout=VLLM_START_TIMEOUT, engine="vllm", vllm_python=str(VLLM_PYTHON),
                       vllm_block_size=VLLM_BLOCK, vllm_kv_cache=str(VLLM_KV_BYTES),
                       worker_args=("--max-model-len", str(VLLM_MAX_MODEL_LEN), "--max-num-seqs", "8",
                                    "--seed", "0"))
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        assert cluster.secret is not None
        servers = []
        for name, role in (("prefill-0", "kv_producer"), ("decode-0", "kv_consumer")):
            child = cluster.child(name)
            assert child.member_id is not None
            info = registered(cluster, child.member_id)
            assert info.kv_events and info.kv_events_replay
            servers.append(VllmServer(role, child.address, child.log_path, child.member_id,
                                      info.kv_events, info.kv_events_replay))
        with ThreadPoolExecutor(len(servers)) as pool:
            for f in [pool.submit(s.warm_up, model_dir.name, cluster.secret) for s in servers]:
                f.result()
        yield VllmPD(servers[0], servers[1], model_dir.name, model_dir, cluster, cluster.secret)
    finally:
        cluster.stop()
