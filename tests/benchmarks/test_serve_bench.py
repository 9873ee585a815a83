"""The load client and ``serve_bench`` against a fake SSE server with known delays."""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks.serving import serve_bench
from benchmarks.serving.load_client import ClientConfig, run_workload
from planner.metrics import Slo, summarize
from planner.workloads import BenchRequest
from tests.benchmarks.fake_openai import DROP, FAIL_500, SILENT, FakeOpenAI

TTFT, TPOT = 0.15, 0.03
SLACK = 0.08  # scheduling noise allowed on a loaded 2-core machine


@pytest.fixture
def fake():
    with FakeOpenAI(ttft_s=TTFT, tpot_s=TPOT) as server:
        yield server


def cfg(server: FakeOpenAI, **kw) -> ClientConfig:
    return ClientConfig(server.url, server.model, progress=False, **kw)


def r(rid: str, n: int = 8, at: float = 0.0, first: int = 100, **kw) -> BenchRequest:
    return BenchRequest(rid, (first, 11, 12, 13), n, at, **kw)


def test_measured_ttft_tpot_itl_match_the_fakes_delays(fake):
    out = asyncio.run(run_workload([r(f"q{i}") for i in range(4)], cfg(fake)))
    assert out.not_sent == 0 and len(out.results) == 4
    for res in out.results:
        assert res.ok and res.output_tokens == 8
        assert TTFT <= res.ttft_s < TTFT + SLACK
        assert TPOT - 0.005 <= res.tpot_s < TPOT + SLACK / 4
        assert len(res.itl_s) == 7 and min(res.itl_s) > TPOT / 3
        assert res.e2e_s == pytest.approx(res.ttft_s + 7 * res.tpot_s)
        assert res.cached_tokens == 0
    body = fake.received[0][1]
    assert body["prompt"] == [100, 11, 12, 13] and body["max_tokens"] == 8
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "fake-model"


def test_open_loop_sends_on_schedule_and_follow_ups_wait(fake):
    reqs = [r("a", at=0.0), r("b", at=0.1), r("c", at=0.2),
            r("a2", after="a", delay_s=0.2), r("a3", after="a2", delay_s=0.0)]
    out = asyncio.run(run_workload(reqs, cfg(fake)))
    res = {x.request_id: x for x in out.results}
    for rid, at in (("a", 0.0), ("b", 0.1), ("c", 0.2)):
        assert at <= res[rid].sent_s < at + 0.05
    # open loop: b and c went out while a was still streaming (a takes ~0.36 s)
    assert res["c"].sent_s < res["a"].sent_s + res["a"].e2e_s
    # a follow-up goes its think time after the request it follows has finished
    a_end = res["a"].sent_s + res["a"].e2e_s
    assert a_end + 0.2 <= res["a2"].sent_s < a_end + 0.2 + 0.05
    assert res["a3"].sent_s >= res["a2"].sent_s + res["a2"].e2e_s
    assert out.duration_s >= res["a3"].sent_s + res["a3"].e2e_s


def test_tokens_without_text_count_from_the_finish_chunk(fake):
    out = asyncio.run(run_workload([r("silent", n=1, first=SILENT)], cfg(fake)))
    (res,) = out.results
    assert res.ok and res.output_tokens == 1 and res.itl_s == []
    assert TTFT <= res.ttft_s < TTFT + SLACK


def test_failures_are_counted_and_never_good(fake):
    reqs = [r("ok"), r("http500", first=FAIL_500), r("dropped", first=DROP)]
    out = asyncio.run(run_workload(reqs, cfg(fake)))
    res = {x.request_id: x for x in out.results}
    assert res["ok"].ok
    assert res["http500"].error.startswith("HTTP 500")
    assert not res["dropped"].ok and res["dropped"].output_tokens == 2
    s = summarize(out.results, out.duration_s, Slo(10.0, 10.0))
    assert (s.completed, s.failed, s.good) == (1, 2, 1)


def test_runs_are_bounded_in_time(fake):
    fake.ttft_s = 5.0  # nothing would finish within the bound
    reqs = [r("a", at=0.0), r("b", at=0.1), r("late", at=0.6)]
    out = asyncio.run(run_workload(reqs, cfg(fake, max_duration_s=0.3, grace_s=0.2)))
    assert out.not_sent == 1
    assert sorted(x.request_id for x in out.results) == ["a", "b"]
    assert all("time bound" in x.error for x in out.results)
    assert 0.5 <= out.duration_s < 1.5


def test_concurrency_cap_and_loopback_only(fake):
    out = asyncio.run(run_workload([r(f"q{i}", n=2) for i in range(3)], cfg(fake, max_concurrency=1)))
    sent = sorted(x.sent_s for x in out.results)
    assert sent[1] - sent[0] >= TTFT + TPOT - 0.01  # one at a time
    with pytest.raises(ValueError, match="loopback"):
        ClientConfig("http://10.1.2.3:8000", "m")


def test_cli_prints_one_json_line_and_writes_plots(fake, tmp_path, capsys):
    out = tmp_path / "run"
    serve_bench.main([
        "--url", fake.url, "--workload", "mixed", "--rate", "20", "--num-requests", "8", "--seed", "4",
        "--mixed-short-prompt", "16", "--mixed-short-output", "4", "--mixed-long-prompt", "64",
        "--mixed-long-output", "2", "--mixed-long-share", "0.2", "--vocab-size", "500",
        "--slo-from-unloaded", "2", "--no-progress", "--out", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["model"] == "fake-model" and rec["machine"]["cpu_count"] >= 1
    assert rec["summary"]["issued"] == 8 and rec["summary"]["failed"] == 0
    un = rec["unloaded"]
    assert 12 <= un["prompt_tokens"] <= 20 and un["max_tokens"] == 16  # shape of the short requests
    assert TTFT <= un["ttft_s"] < TTFT + SLACK and TPOT - 0.005 <= un["tpot_s"] < TPOT + SLACK / 4
    assert rec["summary"]["slo"]["ttft_s"] == pytest.approx(5 * un["ttft_s"])
    assert rec["summary"]["attainment"] == 1.0  # an idle fake meets its own 5x / 2x objectives
    assert set(rec["by_tag"]) == {"short", "long"} and rec["scaling"]["long_share"] == 0.2
    assert len((out / "requests.jsonl").read_text().splitlines()) == 8
    assert (out / "latency_cdf.png").stat().st_size > 1000
    # the prompts the fake received are token ids from the requested space
    assert all(100 <= t < 500 for _, b in fake.received for t in b["prompt"])
