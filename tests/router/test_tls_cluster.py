"""A whole cluster on TLS with mutual certificates (``LocalCluster`` with ``tls``, what
``kvrouter up --tls-dir`` runs): etcd on https with client certificates, the store, the
workers' HTTPS API and the router's calls to them. A completion goes prefill -> store ->
decode through all of it; each internal server refuses a caller without a certificate of
the cluster's CA; the router's public endpoint is plain HTTP."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest

from kvstore.certs import make_certs
from kvstore.client.node import Client
from kvstore.errors import StoreUnavailable
from router.cluster.launcher import LocalCluster
from tests.router.cluster_probe import record

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tls_cluster(cluster_factory, tmp_path_factory: pytest.TempPathFactory) -> LocalCluster:
    tls = make_certs(tmp_path_factory.mktemp("certs"))["node"]
    return cluster_factory(etcd=None, tls=tls, prefill=1, decode=1, mode="disaggregated")


def test_a_completion_crosses_a_tls_cluster(tls_cluster: LocalCluster) -> None:
    assert tls_cluster.etcd_url is not None and tls_cluster.etcd_url.startswith("https://")
    assert tls_cluster.worker_urls and all(u.startswith("https://") for u in tls_cluster.worker_urls.values())
    assert tls_cluster.router_url is not None and tls_cluster.router_url.startswith("http://")
    tls = tls_cluster.spec.tls
    assert tls is not None
    body = {"model": "tiny", "prompt": [5, 6, 7, 8] * 12, "max_tokens": 6, "temperature": 0}
    models = httpx.get(f"{tls_cluster.router_url}/v1/models", trust_env=False, timeout=10).json()
    body["model"] = models["data"][0]["id"]
    resp = httpx.post(f"{tls_cluster.router_url}/v1/completions", json=body, timeout=60, trust_env=False)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 6
    rec = record(tls_cluster.spec.request_log or "", resp.json()["id"])
    assert rec["mode"] == "disaggregated" and rec["prefill_worker"] and rec["decode_workers"], rec
    # The workers and etcd answer a caller with the cluster's certificate ...
    with httpx.Client(verify=tls.client_context(), trust_env=False, timeout=5) as ok:
        for url in tls_cluster.worker_urls.values():
            assert ok.get(f"{url}/health").status_code == 200
        assert ok.get(f"{tls_cluster.etcd_url}/health").status_code == 200
    # ... and refuse one without a certificate (the CA trusted, so only theirs is missing).
    no_cert = ssl.create_default_context(cafile=tls.ca)
    with httpx.Client(verify=no_cert, trust_env=False, timeout=5) as anon:
        for url in [*tls_cluster.worker_urls.values(), tls_cluster.etcd_url]:
            with pytest.raises(httpx.TransportError):
                anon.get(f"{url}/health").raise_for_status()
    store = tls_cluster.child("store").address
    with pytest.raises(StoreUnavailable):
        Client(store, tls=False, auth_token=tls_cluster.secret, timeout=3).stats()
    with Client(store, tls=tls, auth_token=tls_cluster.secret, transport="tcp") as c:
        assert c.stats()["store"]["host"]["blocks"] > 0   # the prefill's blocks, saved over TLS


def test_the_cluster_state_names_https(tls_cluster: LocalCluster) -> None:
    import json

    assert tls_cluster.log_dir is not None
    state = json.loads((Path(tls_cluster.log_dir) / "cluster.json").read_text())
    assert state["etcd"].startswith("https://")
    assert tls_cluster.registered("workers")   # the launcher reads etcd over TLS too
