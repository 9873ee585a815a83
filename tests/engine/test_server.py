"""The worker HTTP API on a real ``kvengine serve`` process, and the event stream underneath.

Unit tests of ``EventStream`` (numbering, ring overflow gap, snapshot consistency, async wake)
come first; the rest runs against one colocated worker on the tiny checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from engine.api.events import LoadFigures, Snapshot, parse_event
from engine.worker.events import EventStream, RateMeter
from kvstore.keys import BlockKey, block_keys
from tests.engine.worker_procs import generate, greedy, metric, start_worker, wait_until

BS = 16


def _k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


# --- EventStream ------------------------------------------------------------------------------


def test_events_are_numbered_and_snapshot_matches_replay():
    ev = EventStream(capacity=100)
    assert ev.snapshot().seq == 0 and ev.since(0) == []
    assert ev.publish_blocks("stored", [_k(1), _k(2), _k(3)]) == 1
    assert ev.publish_load(LoadFigures(waiting=2, kv_total_blocks=8)) == 2
    assert ev.publish_blocks("removed", [_k(2)]) == 3
    snap = ev.snapshot()
    assert snap.seq == 3 and set(snap.blocks) == {_k(1), _k(3)} and snap.load.waiting == 2
    assert [e.seq for e in ev.since(1)] == [2, 3]
    # A reader that resyncs from the snapshot sees exactly the events after it.
    ev.publish_blocks("stored", [_k(4)])
    assert [(e.seq, e.type, e.keys) for e in ev.since(snap.seq)] == [(4, "stored", (_k(4),))]
    with pytest.raises(ValueError):
        ev.publish_blocks("evicted", [_k(1)])


def test_ring_overflow_shows_a_gap_and_the_snapshot_resyncs():
    ev = EventStream(capacity=4)
    for i in range(10):
        ev.publish_blocks("stored", [_k(i)])
    got = ev.since(2)
    assert [e.seq for e in got] == [7, 8, 9, 10]  # 3..6 are gone: the reader sees a gap
    snap = ev.snapshot()
    assert snap.seq == 10 and len(snap.blocks) == 10
    assert [e.seq for e in ev.since(8, limit=1)] == [9]


def test_wait_async_wakes_on_publish_from_another_thread():
    ev = EventStream()

    async def main() -> bool:
        t = threading.Timer(0.05, lambda: ev.publish_blocks("stored", [_k(1)]))
        t.start()
        woke = await ev.wait_async(0, timeout=5)
        timed_out = await ev.wait_async(ev.seq, timeout=0.05)
        return woke and not timed_out

    assert asyncio.run(main())
    assert ev.wait(0, timeout=0) and not ev.wait(1, timeout=0.01)


def test_rate_meter_is_an_ewma_that_ignores_empty_samples():
    m = RateMeter(alpha=0.5)
    assert m.update(0, 1.0) == 0.0
    assert m.update(100, 1.0) == 100.0
    assert m.update(300, 1.0) == 200.0
    assert m.update(10, 0.0) == 200.0


# --- one colocated worker process -------------------------------------------------------------

integration = pytest.mark.integration


@pytest.fixture(scope="module")
def worker(tiny_llama_dir, tmp_path_factory):
    w = start_worker(tiny_llama_dir, tmp_path_factory.mktemp("server-worker"),
                     "--role", "colocated", "--num-blocks", "64", "--load-interval", "0.05")
    yield w
    w.stop()


@pytest.fixture(scope="module")
def http(worker):
    with httpx.Client(base_url=worker.address, timeout=30) as c:
        yield c


def _prompt(n: int, start: int = 3) -> list[int]:
    return [(start + 7 * i) % 509 + 3 for i in range(n)]


@integration
def test_info_health_and_metrics(http, worker):
    info = http.get("/info").json()
    assert info["role"] == "colocated" and info["address"] == worker.address
    assert info["namespace"] == worker.namespace and info["kv_capacity_blocks"] == 64
    assert http.get("/health").json() == {"status": "ok"}
    text = http.get("/metrics").text
    for name in ("kvengine_requests_waiting", "kvengine_kv_cache_usage_ratio",
                 'kvengine_prefix_hit_tokens_total{tier="store"}', "kvengine_step_seconds_bucket"):
        assert name in text


@integration
def test_generate_streams_and_reports_stats(worker):
    tokens, final = generate(worker.address, greedy("g1", _prompt(21), 12))
    assert len(tokens) == 12 and final["finish_reason"] == "length"
    assert final["stats"]["computed_prompt_tokens"] == 21
    # The same prompt again hits the device prefix cache for its one full block.
    again, final2 = generate(worker.address, greedy("g2", _prompt(21), 12))
    assert again == tokens and final2["stats"]["device_hit_tokens"] == BS
    assert final2["stats"]["computed_prompt_tokens"] == 21 - BS


@integration
@pytest.mark.parametrize("body, field_or_text", [
    ({"request_id": "b", "prompt_token_ids": [1, 99999], "sampling": {"max_tokens": 4}},
     "outside the vocabulary"),
    ({"request_id": "b", "prompt_token_ids": [1, 2], "sampling": {"max_tokens": 5000}},
     "exceeds the context window"),
    ({"request_id": "b", "prompt_token_ids": [1, 2], "phase": "prefill",
      "sampling": {"max_tokens": 5000}}, "exceeds the context window"),
    ({"request_id": "b", "prompt_token_ids": []}, "prompt_token_ids"),
    ({"request_id": "b", "prompt_token_ids": [1], "sampling": {"top_p": 2}}, "sampling.top_p"),
    ({"prompt_token_ids": [1]}, "request_id"),
])
def test_bad_input_is_a_400_naming_the_problem(http, body, field_or_text):
    r = http.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert field_or_text in r.json()["error"]


@integration
def test_bad_input_does_not_disturb_a_running_request(worker, http):
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(
        out=generate(worker.address, greedy("steady", _prompt(30, 11), 200))))
    t.start()
    wait_until(lambda: http.get("/snapshot").json()["load"]["running"] == 1,
               what="the request to run")
    assert http.post("/generate", content=b"{not json").status_code == 400
    assert http.post("/generate", json=greedy("bad", [600], 4)).status_code == 400
    t.join(60)
    tokens, final = result["out"]
    assert len(tokens) == 200 and final["finish_reason"] == "length"
    alone, _ = generate(worker.address, greedy("alone", _prompt(30, 11), 200))
    assert tokens == alone


@integration
def test_abort_ends_the_stream_and_frees_blocks(worker, http):
    lines: list[dict] = []
    with httpx.stream("POST", f"{worker.address}/generate",
                      json=greedy("to-abort", _prompt(40, 5), 900), timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                continue
            lines.append(json.loads(line))
            if len(lines) == 3:
                assert http.post("/abort", json={"request_id": "to-abort"}).status_code == 200
    assert lines[-1]["finished"] and lines[-1]["finish_reason"] == "abort"
    assert len(lines) < 900
    total = http.get("/info").json()["kv_capacity_blocks"]
    wait_until(lambda: http.get("/snapshot").json()["load"]["kv_free_blocks"] == total,
               what="every block to be free again")
    assert http.post("/abort", json={"request_id": "unknown"}).status_code == 200
    assert http.post("/abort", json={}).status_code == 400


@integration
def test_client_disconnect_aborts_the_request(worker, http):
    before = metric(worker.address, 'kvengine_requests_finished_total{finish_reason="abort"}')
    with httpx.stream("POST", f"{worker.address}/generate",
                      json=greedy("gone", _prompt(25, 9), 900), timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                break  # one token, then hang up
    wait_until(lambda: metric(worker.address,
                              'kvengine_requests_finished_total{finish_reason="abort"}') == before + 1,
               what="the disconnected request to be aborted")
    wait_until(lambda: http.get("/snapshot").json()["load"]["running"] == 0, what="nothing running")


@integration
def test_events_show_stored_blocks_and_snapshot_resyncs(worker, http):
    snap = Snapshot.from_json(http.get("/snapshot").json())
    prompt = _prompt(2 * BS + 3, 17)
    ns = BlockKey.from_hex(worker.namespace)
    keys = block_keys(ns, prompt, BS)
    events = []
    with httpx.stream("GET", f"{worker.address}/events", params={"since": snap.seq},
                      timeout=30) as r:
        generate(worker.address, greedy("ev", prompt, 4))
        stored: set[BlockKey] = set()
        for line in r.iter_lines():
            if not line:
                continue
            e = parse_event(json.loads(line))
            events.append(e)
            if e.type == "stored":
                stored.update(e.keys)
            if set(keys) <= stored:
                break
    seqs = [e.seq for e in events]
    assert seqs == list(range(snap.seq + 1, snap.seq + 1 + len(seqs)))  # no gap, in order
    # Resync: the snapshot holds the blocks, and is at least as new as what we read.
    snap2 = Snapshot.from_json(http.get("/snapshot").json())
    assert snap2.seq >= seqs[-1] and set(keys) <= set(snap2.blocks)
    # Load reports share the sequence: the worker's first event is its initial load report.
    first = http_events_since(http, 0, 1)
    assert first[0].seq == 1 and first[0].type == "load" and first[0].load.kv_total_blocks == 64


def http_events_since(http, since: int, until: int) -> list:
    out = []
    with http.stream("GET", "/events", params={"since": since}) as r:
        for line in r.iter_lines():
            if line:
                out.append(parse_event(json.loads(line)))
                if out[-1].seq >= until:
                    break
    return out
