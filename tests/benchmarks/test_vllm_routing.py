"""``benchmarks.serving.vllm_routing``'s arithmetic without vLLM: the counters read from a Prometheus
page, a run's cache figures from two reads, the table over repeats and its "ahead" verdicts,
and the ZMQ bridges it puts in front of vllm-router (a real publisher and replay socket)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq

from benchmarks.serving.vllm_routing import (
    COUNTERS,
    bridge_events,
    bridge_replay,
    delta,
    prometheus_sums,
    summarize_runs,
)

PAGE = """# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 120.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 400.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 64.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
"""


def test_prometheus_sums_adds_label_sets_and_ignores_the_rest() -> None:
    got = prometheus_sums(PAGE, COUNTERS)
    assert got == {"prefix_cache_hits": 120.0, "prefix_cache_queries": 400.0,
                   "external_prefix_cache_hits": 64.0, "request_success": 5.0}


def test_delta_sums_instances_and_splits_requests() -> None:
    zero: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
    a = {"prefix_cache_hits": 100.0, "prefix_cache_queries": 300.0, "external_prefix_cache_hits": 30.0,
         "request_success": 3.0}
    b = {"prefix_cache_hits": 20.0, "prefix_cache_queries": 100.0, "external_prefix_cache_hits": 10.0,
         "request_success": 1.0}
    got = delta([zero, zero], [a, b])
    assert got["device_hit_rate"] == pytest.approx(120 / 400)
    assert got["store_hit_rate"] == pytest.approx(40 / 400)
    assert got["reuse_rate"] == pytest.approx(160 / 400)
    assert got["instance_share"] == [0.75, 0.25]
    assert delta([zero], [zero])["device_hit_rate"] is None


def _run(router: str, repeat: int, good: int, p99: float, hit: float) -> dict[str, Any]:
    dist = {"p50": p99 / 2, "p99": p99}
    return {"router": router, "part": "multi_turn", "repeat": repeat,
            "summary": {"goodput": good / 100, "good": good, "ttft_s": dist, "tpot_s": dist, "failed": 0},
            "cache": {"device_hit_rate": hit, "store_hit_rate": 0.1, "reuse_rate": hit + 0.1}}


def test_ahead_means_beyond_the_spread() -> None:
    runs = [_run("ours", r, g, p, 0.5) for r, (g, p) in enumerate([(30, 2.0), (32, 2.2), (31, 2.1)])]
    runs += [_run("vllm_router", r, g, p, 0.5) for r, (g, p) in enumerate([(25, 3.0), (29, 2.9), (27, 3.5)])]
    row = summarize_runs(runs)["multi_turn"]
    assert row["ours"]["good"] == {"median": 31, "min": 30, "max": 32}
    assert row["ahead"] == {"goodput": True, "ttft_p99": True, "hit_rate_level_or_better": True}
    # one repeat of theirs at our worst: no longer ahead by more than the spread
    runs[3] = _run("vllm_router", 0, 30, 1.9, 0.6)
    row = summarize_runs(runs)["multi_turn"]
    assert row["ahead"] == {"goodput": False, "ttft_p99": False, "hit_rate_level_or_better": True}


def test_the_bridges_carry_events_and_replay_requests(tmp_path) -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"ipc://{tmp_path}/events")
    replay = ctx.socket(zmq.ROUTER)
    replay.bind(f"ipc://{tmp_path}/replay")
    events_tcp, replay_tcp = bridge_events(f"ipc://{tmp_path}/events"), bridge_replay(f"ipc://{tmp_path}/replay")
    assert events_tcp.startswith("tcp://127.0.0.1:") and replay_tcp.startswith("tcp://127.0.0.1:")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    sub.connect(events_tcp)
    got = None
    for _ in range(50):   # a subscription takes a moment to reach the publisher through the proxy
        pub.send_multipart([b"topic", b"\x00" * 8, b"payload"])
        try:
            got = sub.recv_multipart()
            break
        except zmq.Again:
            time.sleep(0.05)
    assert got == [b"topic", b"\x00" * 8, b"payload"]
    # vLLM's replay protocol: [identity, b"", start_seq] in, several [identity, b"", seq, payload] out
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.RCVTIMEO, 5000)
    client.connect(replay_tcp)
    client.send_multipart([b"", b"\x00" * 7 + b"\x07"])
    ident, empty, start = replay.recv_multipart()
    assert (empty, start) == (b"", b"\x00" * 7 + b"\x07")
    for seq in (7, 8):
        replay.send_multipart([ident, b"", seq.to_bytes(8, "big"), b"batch"])
    assert client.recv_multipart() == [b"", (7).to_bytes(8, "big"), b"batch"]
    assert client.recv_multipart() == [b"", (8).to_bytes(8, "big"), b"batch"]
    for s in (pub, replay, sub, client):
        s.close(linger=0)
