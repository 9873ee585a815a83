"""The rate sweep end to end against fake endpoints: one running, one launched by the sweep."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import lifecycle
from benchmarks.serving import sweep
from kvstore.proc import free_port
from tests.benchmarks.fake_openai import FakeOpenAI


def point(rate: float, attainment: float) -> dict:
    return {"rate": rate, "summary": {"attainment": attainment}}


def test_max_rate_meeting_90_percent():
    pts = [point(1, 1.0), point(2, 0.95), point(4, 0.85), point(8, 0.99)]
    got = sweep.max_rate_meeting(pts)
    assert got["tested"] == 2  # the recovery at 8 does not count: 4 already failed
    assert got["interpolated"] == pytest.approx(2 + 0.5 * 2)  # 0.95 -> 0.85 crosses 0.9 halfway
    assert sweep.max_rate_meeting([point(1, 0.5)]) == {"tested": None, "interpolated": None}
    assert sweep.max_rate_meeting([point(1, 0.9), point(2, 1.0)]) == {"tested": 2, "interpolated": 2}


def test_endpoint_of_a_launched_configuration():
    assert lifecycle.Configuration("a", command="kvrouter up --port 8123").endpoint() == "http://127.0.0.1:8123"
    assert lifecycle.Configuration("a", command="kvrouter up --port=9000").endpoint() == "http://127.0.0.1:9000"
    assert lifecycle.Configuration("a", command="kvrouter up").endpoint() == "http://127.0.0.1:8000"


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_a_configuration_that_fails_to_start_is_reported_and_the_rest_run(tmp_path, capsys):
    with FakeOpenAI(ttft_s=0.02, tpot_s=0.005) as fake, pytest.raises(SystemExit, match="broken"):
        sweep.main([
            "--launch", f"broken={sys.executable} -c 'raise SystemExit(3)' --port {free_port()}",
            "--config", f"ok={fake.url}", "--rates", "8", "--point-seconds", "0.5", "--unloaded-samples", "1",
            "--mixed-short-prompt", "8", "--mixed-short-output", "2", "--mixed-long-prompt", "16",
            "--mixed-long-output", "2", "--no-progress", "--out", str(tmp_path)])
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "exited with 3" in rec["failed"]["broken"]
    assert list(rec["configs"]) == ["ok"] and rec["configs"]["ok"]["curve"][0]["failed"] == 0


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_sweep_runs_each_configuration_over_the_rates(tmp_path, capsys):
    port = free_port()
    out = tmp_path / "sweep"
    with FakeOpenAI(ttft_s=0.05, tpot_s=0.01) as fake:
        sweep.main([
            "--config", f"running={fake.url}",
            "--launch", f"launched={sys.executable} -m tests.benchmarks.fake_openai --port {port}",
            "--workload", "mixed", "--rates", "4,8", "--point-seconds", "1.2", "--unloaded-samples", "1",
            "--mixed-short-prompt", "8", "--mixed-short-output", "4", "--mixed-long-prompt", "32",
            "--mixed-long-output", "2", "--vocab-size", "300", "--no-progress", "--ready-timeout", "60",
            "--out", str(out)])
        received = len(fake.received)
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(rec["configs"]) == ["running", "launched"] and rec["rates"] == [4.0, 8.0]
    for name, c in rec["configs"].items():
        assert [p["rate"] for p in c["curve"]] == [4.0, 8.0]
        assert all(p["failed"] == 0 and p["issued"] >= 1 for p in c["curve"])
        assert c["unloaded"]["max_tokens"] == 16
    # objectives come from the first configuration, fixed before any load
    first = rec["configs"]["running"]
    assert rec["configs"]["launched"]["slo"] == first["slo"]
    assert first["slo"]["ttft_s"] == pytest.approx(5 * first["unloaded"]["ttft_s"])
    lines = [json.loads(x) for x in (out / "sweep.jsonl").read_text().splitlines()]
    assert [(x["config"], x["rate"]) for x in lines] == [("running", 4), ("running", 8),
                                                           ("launched", 4), ("launched", 8)]
    reqs = {(x["config"], x["rate"]): x for x in lines}  # warm-up + 1 unloaded, then the points
    assert received == 2 + reqs[("running", 4)]["summary"]["issued"] + reqs[("running", 8)]["summary"]["issued"]
    for name in ("latency_vs_rate", "goodput_vs_rate", "goodput_vs_slo_scale"):
        assert (out / f"{name}.png").stat().st_size > 1000
    # point i uses the same prompts (ids carry the seed) in every configuration, fresh ones across points
    def ids(name: str, rate: int) -> set[str]:
        text = (out / "requests" / f"{name}_r{rate}.jsonl").read_text()
        return {json.loads(x)["request_id"] for x in text.splitlines()}

    assert ids("running", 4) == ids("launched", 4) and ids("running", 8) == ids("launched", 8)
    assert not ids("running", 4) & ids("running", 8)
    assert (out / "launched.log").exists()


def test_fixed_and_per_length_objectives_reach_the_points(tmp_path, capsys):
    """--ttft-slo-ms with a per-token slope (how compare hands the first configuration's
    objectives on), and --ttft-slo-per-length (a second, long probe at the start)."""
    common = ["--workload", "mixed", "--rates", "4", "--point-seconds", "1.2", "--unloaded-samples", "1",
              "--mixed-short-prompt", "8", "--mixed-short-output", "4", "--mixed-long-prompt", "32",
              "--mixed-long-output", "2", "--vocab-size", "300", "--no-progress"]
    with FakeOpenAI(ttft_s=0.05, tpot_s=0.01) as fake:
        sweep.main(["--config", f"fixed={fake.url}", *common, "--out", str(tmp_path / "a"),
                    "--ttft-slo-ms", "500", "--tpot-slo-ms", "40", "--ttft-slo-per-token-ms", "2",
                    "--ttft-slo-ref-tokens", "100"])
        fixed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["configs"]["fixed"]
        n = len(fake.received)
        sweep.main(["--config", f"probed={fake.url}", *common, "--out", str(tmp_path / "b"),
                    "--ttft-slo-per-length"])
        probed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["configs"]["probed"]
        lengths = [len(b.get("prompt", [])) for _, b in fake.received[n:]]
    assert fixed["slo"] == {"ttft_s": 0.5, "tpot_s": 0.04, "ttft_per_token_s": 0.002, "ref_prompt_tokens": 100}
    u = probed["unloaded"]
    assert u["long_prompt_tokens"] > u["prompt_tokens"] and u["long_ttft_s"] > 0
    assert probed["slo"]["ref_prompt_tokens"] == u["prompt_tokens"]
    assert lengths[:3] == [u["prompt_tokens"]] * 2 + [u["long_prompt_tokens"]]  # warm-up, sample, long probe
