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
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
_READY = re.compile(r"kvengine ready address=(\S+) worker_id=(\S+) role=(\S+) namespace=(\S+)")


@dataclass
class WorkerProc:
    proc: subprocess.Popen
    log_dir: Path
    address: str = ""
    worker_id: str = ""
    namespace: str = ""
    _files: list = field(default_factory=list)

    @property
    def stderr(self) -> str:
        return (self.log_dir / "stderr.log").read_text(errors="replace")

    def wait_ready(self, timeout: float) -> "WorkerProc":
        out = self.log_dir / "stdout.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _READY.search(out.read_text(errors="replace"))
            if m:
                self.address, self.worker_id, _, self.namespace = m.groups()
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvengine serve exited with {self.proc.returncode}:\n{self.stderr}")
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"kvengine serve not ready within {timeout} s:\n{self.stderr}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in self._files:
            f.close()
        self._files.clear()


def start_worker(model_dir: Path, log_dir: Path, *flags: str, timeout: float = 90.0) -> WorkerProc:
    log_dir.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "engine.cli", "serve", "--model", str(model_dir), "--port", "0",
            "--threads", "1", *flags]
    out = open(log_dir / "stdout.log", "wb")
    err = open(log_dir / "stderr.log", "wb")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=err, env=env)
    return WorkerProc(proc, log_dir, _files=[out, err]).wait_ready(timeout)


def generate(address: str, body: dict[str, Any], timeout: float = 60.0
             ) -> tuple[list[int], dict[str, Any]]:
    """POST /generate; (every streamed token id, the final line). Raises on a non-200."""
    tokens: list[int] = []
    with httpx.stream("POST", f"{address}/generate", json=body, timeout=timeout) as r:
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
