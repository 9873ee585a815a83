"""What the end-to-end tests read from a running cluster: Prometheus metrics, request records,
worker facts. Polls have deadlines; nothing sleeps a fixed time."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Metrics", "scrape", "records", "record", "wait_until", "worker_id", "random_prompt"]

T = TypeVar("T")


class Metrics:
    """One scrape of a ``/metrics`` page: ``m.get("name_total", label=value)`` (0.0 if absent)."""

    def __init__(self, text: str) -> None:
        self.samples: dict[tuple[str, frozenset], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def get(self, name: str, **labels: str) -> float:
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def total(self, name: str, **labels: str) -> float:
        """Sum over the samples of ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)


def scrape(url: str) -> Metrics:
    resp = httpx.get(f"{url}/metrics", timeout=5, trust_env=False)
    resp.raise_for_status()
    return Metrics(resp.text)


def wait_until(fn: Callable[[], T], timeout: float = 10.0, what: str = "condition") -> T:
    """``fn()`` once truthy, polled with a growing interval; AssertionError at the deadline."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.2)


def records(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def record(path: str | Path, response_id: str, choice: int = 0, timeout: float = 10.0) -> dict[str, Any]:
    """The request record of choice ``choice`` of the OpenAI response ``response_id``."""
    rid = f"{response_id}-{choice}"

    def find() -> dict[str, Any] | None:
        return next((r for r in records(path) if r["request_id"] == rid), None)

    return wait_until(find, timeout, f"the request record {rid}")


def worker_id(url: str, secret: str | None = None) -> str:
    """The worker's id from its ``/info`` (which needs the cluster secret, when it has one)."""
    from kvstore.secret import bearer_headers

    return httpx.get(f"{url}/info", timeout=5, trust_env=False,
                     headers=bearer_headers(secret)).json()["worker_id"]


def random_prompt(n: int, seed: int, vocab_size: int) -> list[int]:
    """``n`` token ids drawn from the whole vocabulary, deterministic in ``seed``. With the
    tiny byte-level model many are half characters, so prompts and outputs split UTF-8
    characters anywhere: the text comparisons are exact all the same."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(n)]
