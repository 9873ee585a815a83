"""What both chaos benchmarks use (``benchmarks.chaos.chaos_bench``, one host; ``benchmarks.chaos.chaos_hosts``,
``--hosts N``): ``kvrouter up`` as a child (:class:`Cluster`), the router's request log read
as it grows (:func:`read_records`) and the launcher's restart counts (:func:`launcher_restarts`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import lifecycle

__all__ = ["Cluster", "read_records", "launcher_restarts"]


class Cluster:
    """``kvrouter up`` as a child; what it runs, read from its ``cluster.json``."""

    def __init__(self, args: argparse.Namespace, out: Path, model: str) -> None:
        self.log_dir = out / "logs"
        self.request_log = out / "requests.jsonl"
        for old in (self.request_log, out / "up.log"):
            old.unlink(missing_ok=True)
        self.up_log = open(out / "up.log", "w")
        from kvstore.proc import free_port
        argv = [sys.executable, "-m", "router.cli", "up", "--model", model, "--port", str(free_port()),
                "--prefill", str(args.prefill), "--decode", str(args.decode), "--store-memory", "256M",
                "--log-dir", str(self.log_dir), "--request-log", str(self.request_log),
                "--ready-timeout", str(args.ready_timeout)]
        if getattr(args, "hosts", 0):   # a store and a worker per host; every reuse through the store
            argv += ["--hosts", str(args.hosts), "--worker-arg=--no-prefix-caching"]
        self.proc = lifecycle.popen(argv, stdout=self.up_log, stderr=self.up_log)
        deadline = time.monotonic() + args.ready_timeout
        while "The router is up at" not in (out / "up.log").read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvrouter up did not come up (exit {self.proc.poll()}); see {out / 'up.log'}:\n"
                                   + (out / "up.log").read_text()[-2000:])
            time.sleep(0.2)
        state = self.state()
        self.router: str = state["router"]
        self.etcd: str = state["etcd"]
        self.name: str = state["cluster"]
        self.metrics_url: str | None = state.get("metrics")
        # The secret, from the file kvrouter up wrote: what the bench sends to workers itself.
        self.secret = Path(state["secret_file"]).read_text().strip() if state.get("secret_file") else None

    def state(self) -> dict[str, Any]:
        for _ in range(50):   # rewritten atomically; absent only between runs
            try:
                return json.loads((self.log_dir / "cluster.json").read_text())
            except (OSError, ValueError):
                time.sleep(0.05)
        raise RuntimeError("kvrouter up's cluster.json is gone")

    def registered(self) -> set[str]:
        from kvstore.coord import layout
        from kvstore.coord.etcd import EtcdClient

        with EtcdClient(self.etcd, timeout=1.0) as etcd:
            return {k.rsplit("/", 1)[1] for kind in ("workers", "stores")
                    for k in etcd.get_prefix(layout.prefix(self.name, kind))[0]}

    def stop(self) -> None:
        lifecycle.stop(self.proc, 60)
        self.up_log.close()


def read_records(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The whole JSON lines of the request log past ``offset``; and the offset after them."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    return [json.loads(x) for x in data[:end].splitlines() if x.strip()], offset + end


def launcher_restarts(url: str | None) -> dict[str, float]:
    """Restarts per child, from the launcher's metrics at ``url`` (none without one)."""
    if not url:
        return {}
    text = httpx.get(url, timeout=5, trust_env=False).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^kvrouter_up_child_restarts_total\{child="([^"]+)"[^}]*\} (\S+)$', text, re.M)}
