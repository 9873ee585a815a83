"""``kvrouter up`` as a user runs it: it comes up part by part, the ``curl`` line and the
``openai`` snippet it prints work as printed, the cluster secret reaches every child through
a 0600 file (never a command line), children killed are restarted while the cluster serves,
and SIGTERM stops every child, leaving none. A taken router port fails the start before
anything is reported ready. The supervisor's backoff and deliberate stops, on small real
processes."""

from __future__ import annotations

import http.server
import json
import os
import queue
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from router.cluster.child import ChildProcess
from router.cluster.launcher import ClusterSpec, LaunchError, LocalCluster
from router.cluster.supervisor import Supervisor
from tests.procs import descendants, running
from tests.router.cluster_probe import Metrics, wait_until

pytestmark = pytest.mark.integration

VENV_BIN = str(Path(sys.executable).parent)


class Lines:
    """A child's stdout, line by line, read on a thread so waits can have deadlines."""

    def __init__(self, stream) -> None:
        self.seen: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def until(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {timeout} s; got:\n"
                                     + "\n".join(self.seen)) from None
            if line is None:
                raise AssertionError(f"output ended before {pattern!r}; got:\n" + "\n".join(self.seen))
            self.seen.append(line)
            if re.search(pattern, line):
                return line

    def until_all(self, patterns: list[str], timeout: float) -> None:
        """Read on until every pattern has matched a line (in any order)."""
        deadline = time.monotonic() + timeout
        left = [p for p in patterns if not any(re.search(p, line) for line in self.seen)]
        while left:
            self.until("|".join(f"(?:{p})" for p in left), max(0.0, deadline - time.monotonic()))
            left = [p for p in left if not re.search(p, self.seen[-1])]


def test_kvrouter_up_serves_and_stops_cleanly(tiny_model_dir: Path, tmp_path: Path, free_port) -> None:
    port = free_port()
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "up", "--model", str(tiny_model_dir),
         "--port", str(port), "--prefill", "1", "--decode", "1", "--log-dir", str(tmp_path / "logs"),
         "--store-memory", "64M"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)
    out = Lines(proc.stdout)
    try:
        metrics_url = out.until("launcher metrics at", 30).split("launcher metrics at ")[1].strip()
        secret_line = out.until("cluster secret in", 30)
        for part in ("etcd ready", "store ready", "prefill worker .* ready", "decode worker .* ready",
                     "router ready"):
            out.until(part, 120)
        curl = out.until(r"^curl ", 30)
        out.until(r"^python - <<'EOF'$", 5)
        snippet = [out.until(r".*", 5)]
        while snippet[-1] != "EOF":
            snippet.append(out.until(r".*", 5))
        out.until("Ctrl-C stops everything", 5)
        children = descendants(proc.pid)
        assert len(children) >= 5                  # etcd, store, 2 workers, router

        # The printed commands work as printed.
        done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        body = json.loads(done.stdout)
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] >= 1
        done = subprocess.run(["bash", "-c", "python - <<'EOF'\n" + "\n".join(snippet) + "\n"],
                              capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr

        # The cluster secret: a 0600 file in the log directory, handed on as its path.
        secret_file = Path(secret_line.split("cluster secret in ")[1].split()[0])
        assert secret_file.parent == tmp_path / "logs"
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
        secret = secret_file.read_text().strip()
        assert len(secret) >= 32
        state = json.loads((tmp_path / "logs" / "cluster.json").read_text())
        assert state["secret_file"] == str(secret_file)
        for name, child in state["children"].items():
            assert secret not in Path(f"/proc/{child['pid']}/cmdline").read_text(), name
            environ = Path(f"/proc/{child['pid']}/environ").read_bytes().split(b"\0")
            assert f"KVCACHE_CLUSTER_SECRET_FILE={secret_file}".encode() in environ, name
            assert not any(e.startswith(b"KVCACHE_CLUSTER_SECRET=") for e in environ), name

        # A worker and the store killed: both restarted, counted, and the cluster serves on.
        for name in ("prefill-0", "store"):
            os.kill(state["children"][name]["pid"], signal.SIGKILL)
        out.until_all([rf"{name} .*exited unexpectedly with code -9" for name in ("prefill-0", "store")]
                      + [rf"\] {name} back " for name in ("prefill-0", "store")], 60)
        metrics = Metrics(httpx.get(metrics_url, timeout=5, trust_env=False).text)
        for name, kind in (("prefill-0", "prefill"), ("store", "store")):
            assert metrics.get("kvrouter_up_child_restarts_total", child=name, kind=kind) == 1
        assert metrics.get("kvrouter_up_child_restarts_total", child="decode-0", kind="decode") == 0
        now = json.loads((tmp_path / "logs" / "cluster.json").read_text())["children"]
        assert now["prefill-0"]["pid"] != state["children"]["prefill-0"]["pid"]
        assert now["prefill-0"]["id"] != state["children"]["prefill-0"]["id"]
        assert now["prefill-0"]["starts"] == 2 and now["prefill-0"]["state"] == "running"
        done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0 and json.loads(done.stdout)["usage"]["completion_tokens"] >= 1, done
        assert proc.poll() is None
        children = descendants(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0, "\n".join(out.seen)
    out.until("all stopped", 5)
    stopped = {m.group(1): m.group(2) for line in out.seen
               if (m := re.search(r"stopped (\S+) \(exit (-?\d+)\)$", line))}
    assert stopped.keys() == {"router", "decode-0", "prefill-0", "store", "etcd"}
    assert all(stopped[name] == "0" for name in ("router", "decode-0", "prefill-0", "store")), stopped
    assert not [pid for pid in children if running(pid)]
    assert not secret_file.exists()          # the secret goes with the cluster


def test_up_refuses_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="not a checkpoint"):
        LocalCluster(ClusterSpec(model=str(tmp_path), port=0)).start()
    with pytest.raises(ValueError, match="decode worker"):
        ClusterSpec(decode=0)
    with pytest.raises(ValueError, match="colocated mode needs at least one worker"):
        ClusterSpec(mode="colocated", colocated=0)


class _Impostor(http.server.BaseHTTPRequestHandler):
    """Another process's server on the router's port: answers every GET as a healthy router."""

    def do_GET(self) -> None:  # the http.server API
        body = json.dumps({"status": "ok", "workers": 99, "data": [{"id": "other"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_up_fails_on_a_taken_router_port_before_reporting_anything_ready(tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Impostor)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
        done = subprocess.run(
            [sys.executable, "-m", "router.cli", "up", "--model", str(tiny_model_dir), "--port", str(port),
             "--log-dir", str(tmp_path / "logs"), "--store-memory", "64M", "--ready-timeout", "60"],
            capture_output=True, text=True, env=env, timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert f"port {port} on 127.0.0.1 is already in use" in out, out
    assert "ready" not in done.stdout, out


def _fake(tmp: Path, name: str, script: str, kind: str = "prefill") -> ChildProcess:
    """A real small child: ``sh -c script``; ready once it printed ``ready id=<pid>``."""
    return ChildProcess(name, ["sh", "-c", script], tmp / f"{name}.log", kind=kind,
                        ready_pattern=r"^ready id=(?P<id>\d+)")


def test_supervisor_restarts_with_backoff_and_leaves_a_deliberate_stop_stopped(tmp_path: Path) -> None:
    cluster = LocalCluster(ClusterSpec(), on_status=lambda line: None)
    cluster.log_dir = tmp_path
    serve = "echo ready id=$$; exec sleep 60"
    cluster.children = [_fake(tmp_path, "prefill-0", serve), _fake(tmp_path, "decode-0", serve, "decode"),
                        _fake(tmp_path, "flaky", "echo starting; exit 3")]
    lines: list[str] = []
    try:
        for c in cluster.children:
            c.start()
        wait_until(lambda: all(cluster.is_ready(c) for c in cluster.children[:2]), 10, "fakes ready")
        sup = Supervisor(cluster, lines.append, base_delay=0.05, max_delay=0.4, stable_after=60)

        def poll_until(cond, what: str, timeout: float = 10.0):
            def step():
                sup.poll()
                return cond()
            return wait_until(step, timeout, what)

        first = cluster.child("prefill-0").pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        poll_until(lambda: any(line.startswith("prefill-0 back") for line in lines), "prefill-0 back")
        assert cluster.child("prefill-0").pid != first and cluster.child("prefill-0").alive()
        assert cluster.child("prefill-0").member_id == str(cluster.child("prefill-0").pid)
        assert sup.metrics.restarts.labels("prefill-0", "prefill")._value.get() == 1

        cluster.stop_child("decode-0", timeout=5)            # the cluster's own stop
        poll_until(lambda: sup.states()["decode-0"] == "stopped", "decode-0 stopped")
        for _ in range(5):
            sup.poll()
        assert not cluster.child("decode-0").alive()
        assert sup.metrics.restarts.labels("decode-0", "decode")._value.get() == 0
        state = json.loads((tmp_path / "cluster.json").read_text())
        assert state["children"]["decode-0"]["state"] == "stopped"

        # A child that never comes up is retried, each time later, up to max_delay.
        poll_until(lambda: sup.metrics.restarts.labels("flaky", "prefill")._value.get() >= 5, "flaky retried")
        delays = [float(line.split("restarting in ")[1].split()[0]) for line in lines if line.startswith("flaky")
                  and "restarting in" in line]
        assert delays[:5] == [0.05, 0.1, 0.2, 0.4, 0.4], delays
    finally:
        for c in cluster.children:
            c.stop(2)
