"""The worker API's authentication, on a real ``kvengine serve`` process holding a cluster
secret: every endpoint but /health and /metrics answers 401 without it or with a wrong one;
a worker refuses to listen beyond loopback without a secret unless --insecure."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from engine.worker import cli
from engine.worker.config import WorkerConfig
from kvstore import secret
from tests.engine.worker_procs import generate, greedy, start_worker, worker_env
from tests.procs import REPO

pytestmark = pytest.mark.integration

SECRET = "s3cret-" + "x" * 36
GOOD = secret.bearer_headers(SECRET)
BAD = secret.bearer_headers(SECRET + "y")


@pytest.fixture(scope="module")
def worker(tiny_llama_dir, tmp_path_factory):
    path = secret.write_secret_file(tmp_path_factory.mktemp("auth-secret") / "secret", SECRET)
    w = start_worker(tiny_llama_dir, tmp_path_factory.mktemp("auth-worker"),
                     "--num-blocks", "32", "--cluster-secret-file", str(path))
    yield w
    w.stop()


CALLS = [
    ("POST", "/generate", {"json": greedy("auth-g", [5, 6, 7], 2)}),
    ("POST", "/abort", {"json": {"request_id": "someone-elses"}}),
    ("GET", "/events", {}),
    ("GET", "/snapshot", {}),
    ("GET", "/info", {}),
    ("GET", "/no-such-path", {}),
]


@pytest.mark.parametrize("headers", [None, BAD, {"Authorization": SECRET},
                                     {"Authorization": f"Basic {SECRET}"}],
                         ids=["none", "wrong", "no-scheme", "basic"])
@pytest.mark.parametrize("method, path, kw", CALLS, ids=[c[1] for c in CALLS])
def test_every_endpoint_needs_the_secret(worker, method, path, kw, headers):
    r = httpx.request(method, worker.address + path, headers=headers, timeout=10, **kw)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    assert "unauthorized" in r.json()["error"]


def test_with_the_secret_everything_works_and_health_metrics_stay_open(worker):
    tokens, final = generate(worker.address, greedy("auth-ok", [5, 6, 7], 3), headers=GOOD)
    assert len(tokens) == 3 and final["finish_reason"] == "length"
    with httpx.Client(base_url=worker.address, timeout=10) as c:
        assert c.post("/abort", json={"request_id": "x"}, headers=GOOD).status_code == 200
        assert c.get("/snapshot", headers=GOOD).json()["seq"] >= 0
        assert c.get("/info", headers=GOOD).json()["worker_id"] == worker.worker_id
        with c.stream("GET", "/events", params={"since": 0}, headers=GOOD) as r:
            assert r.status_code == 200
        assert c.get("/health").json() == {"status": "ok"}
        assert "kvengine_requests_running" in c.get("/metrics").text


def test_refuses_to_listen_beyond_loopback_without_a_secret(tiny_llama_dir):
    args = [sys.executable, "-m", "engine.worker.cli", "serve", "--model", str(tiny_llama_dir),
            "--host", "0.0.0.0", "--port", "0"]
    r = subprocess.run(args, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to serve the engine worker on 0.0.0.0" in lines[0], r.stderr
    assert "--insecure" in lines[0]


def _config(argv: list[str], monkeypatch, **env: str) -> WorkerConfig:
    for name in (secret.ENV, secret.ENV_FILE):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return cli.config_from_args(cli.build_parser().parse_args(["serve", *argv]))


def test_secret_flags_environment_and_insecure(monkeypatch, tmp_path):
    assert _config([], monkeypatch).cluster_secret is None  # loopback dev mode
    assert _config(["--host", "0.0.0.0", "--insecure"], monkeypatch).cluster_secret is None
    cfg = _config(["--host", "0.0.0.0", "--cluster-secret", "v"], monkeypatch)
    assert cfg.cluster_secret == "v" and "v'" not in repr(cfg)
    assert _config(["--host", "0.0.0.0"], monkeypatch, KVCACHE_CLUSTER_SECRET="e").cluster_secret == "e"
    path = secret.write_secret_file(tmp_path / "s", "f")
    assert _config(["--cluster-secret", "v", "--cluster-secret-file", str(path)],
                   monkeypatch).cluster_secret == "f"
    with pytest.raises(secret.InsecureBind):
        _config(["--host", "10.1.2.3"], monkeypatch)
    with pytest.raises(secret.SecretError):
        _config(["--cluster-secret-file", str(tmp_path / "missing")], monkeypatch)


def test_the_store_client_gets_the_resolved_secret(monkeypatch):
    import kvstore

    seen: list[dict] = []
    monkeypatch.setattr(kvstore, "connect", lambda *a, **kw: seen.append(kw) or object())
    cli._connect_store(WorkerConfig(store="127.0.0.1:1", cluster_secret="abc"))
    cli._connect_store(WorkerConfig(etcd="http://127.0.0.1:2379", cluster_secret="abc"))
    assert [kw["auth_token"] for kw in seen] == ["abc"] * 6   # load, save and lookup clients
    seen.clear()
    cli._connect_store(WorkerConfig(store="127.0.0.1:1"))  # no secret: the client's own env path
    assert [kw["auth_token"] for kw in seen] == [None] * 3


def test_a_call_meant_for_another_worker_id_is_misdirected_and_reaches_nothing(worker):
    # A stale registration (a killed worker's, its lease not yet expired) points at the port
    # its replacement now holds: the replacement must not serve calls meant for the old id.
    me = httpx.get(worker.address + "/info", headers=GOOD, timeout=10).json()["worker_id"]
    other = {**GOOD, "X-KV-Worker-Id": me + "-old"}
    req = greedy("auth-misdirected", [5, 6, 7], 2)
    r = httpx.post(worker.address + "/generate", json=req, headers=other, timeout=10)
    assert r.status_code == 421 and "misdirected" in r.json()["error"], r.text
    assert httpx.get(worker.address + "/health", headers=other, timeout=10).status_code == 421
    # Nothing was submitted: the same request id is free for the worker it was meant for.
    tokens, final = generate(worker.address, req, headers={**GOOD, "X-KV-Worker-Id": me})
    assert len(tokens) == 2 and final["finish_reason"] == "length"
