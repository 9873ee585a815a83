"""Test helpers: ``kvengine serve`` worker subprocesses and an NDJSON ``/generate`` client.

``start_worker(model_dir, log_dir, *flags)`` starts a worker on a free port with one torch
thread and waits (with a deadline) for its readiness line. ``generate(address, body)`` posts
one request and returns its token ids and final line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx

from kvstore import secret
from tests.procs import ServiceProc, spawn


@dataclass
class WorkerProc(ServiceProc):
    NAME: ClassVar[str] = "kvengine serve"
    READY: ClassVar[re.Pattern[str]] = re.compile(
        r"kvengine ready address=(\S+) worker_id=(\S+) role=(\S+) namespace=(\S+)")

    worker_id: str = ""
    namespace: str = ""

    def _on_ready(self, m: re.Match[str]) -> None:
        self.address, self.worker_id, _, self.namespace = m.groups()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        return super().stop(sig, timeout)


def worker_env(**extra: str) -> dict[str, str]:
    """The environment a test worker gets: ours, one OpenMP thread, and no cluster secret
    inherited from the shell (a test that wants one passes it)."""
    env = {k: v for k, v in os.environ.items() if k not in (secret.ENV, secret.ENV_FILE)}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def start_worker(model_dir: Path, log_dir: Path, *flags: str, timeout: float = 90.0,
                 env: dict[str, str] | None = None) -> WorkerProc:
    args = [sys.executable, "-m", "engine.worker.cli", "serve", "--model", str(model_dir), "--port", "0",
            "--threads", "1", *flags]
    proc, files = spawn(args, log_dir, worker_env() if env is None else env)
    return WorkerProc(proc, log_dir, _files=files).wait_ready(timeout, interval=0.05)


def generate(address: str, body: dict[str, Any], timeout: float = 60.0,
             headers: dict[str, str] | None = None) -> tuple[list[int], dict[str, Any]]:
    """POST /generate; (every streamed token id, the final line). Raises on a non-200."""
    tokens: list[int] = []
    with httpx.stream("POST", f"{address}/generate", json=body, timeout=timeout,
                      headers=headers) as r:
        if r.status_code != 200:
            r.read()
            raise AssertionError(f"/generate answered {r.status_code}: {r.text}")
        for line in r.iter_lines():
            if not line:
                continue
            obj = json.loads(line)
            if obj.get("finished"):
                return tokens, obj
            tokens.extend(obj["token_ids"])
    raise AssertionError("the stream ended without a final line")


def greedy(request_id: str, prompt: list[int], max_tokens: int, phase: str = "full",
           output: list[int] | None = None) -> dict[str, Any]:
    return {"request_id": request_id, "prompt_token_ids": prompt, "phase": phase,
            "output_token_ids": output or [],
            "sampling": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}


def metric(address: str, name: str) -> float:
    """One sample's value from GET /metrics (``name`` with its labels, as printed)."""
    text = httpx.get(f"{address}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"metric {name} not found")


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout} s")
