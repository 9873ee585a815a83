"""The simulator's mechanics (planner.sim) on a synthetic profile whose every time is known.

Profile: a prefill step costs 0.1 s + 1 ms a token (no attention term); a decode step 0.05 s
+ 0.01 s a sequence (no context term); a store load 2 ms + 1 ms per 737,280-byte block, a save
1 ms + 2 ms a block. So a 100-token prompt alone takes 0.2 s to prefill and each token after
it 0.06 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from engine.profile import format as pf
from planner.sim.cluster import SimCluster
from planner.sim.config import ClusterConfig, from_up_flags, parse_bytes
from planner.sim.costs import StepCosts
from planner.sim.run import Profiles, simulate_point, unloaded
from planner.sim.store import SimStore
from planner.sim.worker import WorkerSpec
from planner.workloads import BenchRequest, TokenSpace, Workload
from router.placement.decode import Balance

REPO = Path(__file__).resolve().parents[2]
BLOCK = 737280


def profile(threads: int = 1) -> pf.Profile:
    pre = [pf.PrefillPoint(n, 0, 0, 0.1 + 0.001 * n) for n in (16, 64, 256, 1024)]
    dec = [pf.DecodePoint(b, c, 0.05 + 0.01 * b) for b in (1, 4, 16) for c in (128, 1024)]
    load = [pf.TransferPoint(n, n * BLOCK, 0.002 + 0.001 * n) for n in (1, 4, 16)]
    save = [pf.TransferPoint(n, n * BLOCK, 0.001 + 0.002 * n) for n in (1, 4, 16)]
    model = pf.ModelShape("synthetic", "llama", 30, 9, 3, 64, 576, 1536, 49152, "float32", 16,
                          BLOCK // 16, BLOCK)
    hw = pf.Hardware("cpu", "test", 2, threads, "x", "x", "native")
    curves = {n: pf.Curve(tuple(p), pf.fit_curve(n, p)) for n, p in
              (("prefill", pre), ("decode", dec), ("store_load", load), ("store_save", save))}
    return pf.Profile(hw, model, pf.StoreInfo("shm", "synthetic"), curves)


PROFILES = Profiles([profile()])
SPACE = TokenSpace()


def colocated(**kw) -> ClusterConfig:
    return ClusterConfig(name="colo", mode="colocated", prefill=0, decode=0, colocated=kw.pop("n", 1),
                         colocated_spec=WorkerSpec(role="colocated", **kw), store_memory_bytes=1 << 30)


def split(p: int = 1, d: int = 1, **kw) -> ClusterConfig:
    return ClusterConfig(name="split", prefill=p, decode=d, prefill_spec=WorkerSpec(role="prefill", **kw),
                         decode_spec=WorkerSpec(role="decode", **kw), store_memory_bytes=1 << 30)


def prompt(n: int, start: int = 1000) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def run(config: ClusterConfig, reqs: list[BenchRequest], **kw):
    return SimCluster(config, PROFILES.costs_for).run_workload(reqs, **kw)


def test_step_costs_follow_the_profile() -> None:
    c = StepCosts(profile())
    assert c.prefill_s(100) == pytest.approx(0.2, rel=1e-6)
    assert c.prefill_s(100, chunk=50) == pytest.approx(0.3, rel=1e-6)  # two overheads
    for b in (1, 4, 16):   # measured points come back exactly; between them, interpolated
        assert c.decode_s(b, 128) == pytest.approx(0.05 + 0.01 * b, rel=1e-6)
    assert c.decode_s(8, 600) == pytest.approx(0.13, rel=1e-6)
    assert c.decode_s(32, 128) == pytest.approx(0.37, rel=1e-3)   # beyond the grid: the fit
    assert c.step_s([128, 128], [(10, 0)]) == pytest.approx(0.07 + 0.01, rel=1e-6)
    assert c.load_s(4) == pytest.approx(0.006) and c.save_s(4) == pytest.approx(0.009)
    assert c.load_s(0) == c.save_s(0) == 0.0


def serving(hop_s: float = 0.01, step_s: float = 0.002, token_s: float = 0.003) -> pf.Serving:
    return pf.Serving("synthetic", 32, hop_s, step_s, token_s, 0.3, 0.27,
                      (pf.ServingPoint(2, 128, 96, 0.08, 0.07),))


def test_a_serving_section_adds_the_stack_to_decode_steps_and_its_hop_to_messages() -> None:
    plain, served = StepCosts(profile()), StepCosts(dataclasses.replace(profile(), serving=serving()))
    assert plain.hop_s == 0.0 and served.hop_s == 0.01
    # A step that streams n tokens costs step_s + n * token_s more; a prefill-only step nothing more.
    assert served.step_s([128] * 4, []) - plain.step_s([128] * 4, []) == pytest.approx(0.002 + 4 * 0.003)
    assert served.step_s([128], [(10, 0)]) - plain.step_s([128], [(10, 0)]) == pytest.approx(0.005)
    assert served.step_s([], [(100, 0)]) == plain.step_s([], [(100, 0)])
    # An unloaded colocated request: its first token three hops later, each next one a step later.
    req = [BenchRequest("a", prompt(100), 3)]
    cfg = colocated(num_blocks=64)
    base = SimCluster(cfg, PROFILES.costs_for).run_workload(req).results[0]
    with_stack = SimCluster(cfg, Profiles([dataclasses.replace(profile(), serving=serving())]).costs_for)
    r = with_stack.run_workload(req).results[0]
    assert r.ttft_s == pytest.approx(base.ttft_s + 3 * 0.01, rel=1e-6)
    assert r.itl_s == pytest.approx([g + 0.005 for g in base.itl_s], rel=1e-6)
    # A configuration's own hop overrides the profile's.
    fixed = SimCluster(dataclasses.replace(cfg, hop_s=0.0), with_stack._costs_for).run_workload(req).results[0]
    assert fixed.ttft_s == pytest.approx(base.ttft_s, rel=1e-6)


def test_the_prefill_factor_scales_prefill_work_and_nothing_else() -> None:
    loaded = dataclasses.replace(serving(), prefill_factor=1.5)
    plain, served = StepCosts(profile()), StepCosts(dataclasses.replace(profile(), serving=loaded))
    # A prefill-only step (overhead and chunks) costs 1.5x the curves'.
    assert served.step_s([], [(100, 0), (50, 20)]) == pytest.approx(1.5 * plain.step_s([], [(100, 0), (50, 20)]))
    # A mixed step: its decode part as before (plus the stack), its chunk's marginal time 1.5x.
    chunk = plain.chunk_s(10, 0)
    assert served.step_s([128], [(10, 0)]) - plain.step_s([128], [(10, 0)]) == pytest.approx(0.005 + 0.5 * chunk)
    # Decode-only steps are untouched by the factor.
    assert served.step_s([128] * 4, []) == pytest.approx(StepCosts(dataclasses.replace(
        profile(), serving=serving())).step_s([128] * 4, []))


def test_the_serving_section_round_trips_through_the_profile_file(tmp_path: Path) -> None:
    prof = dataclasses.replace(profile(), serving=dataclasses.replace(
        serving(), prefill_factor=1.2, prefill_points=(pf.ServingPrefillPoint(384, 2, 2.1, 1.8, 1.5),)))
    back = pf.load(pf.save(prof, tmp_path / "p.json"))
    assert back.serving == prof.serving and back.curves.keys() == prof.curves.keys()
    assert "serving" not in json.loads(pf.save(profile(), tmp_path / "q.json").read_text())
    assert pf.load(tmp_path / "q.json").serving is None


def test_one_colocated_request_costs_a_prefill_then_decode_steps() -> None:
    out = run(colocated(), [BenchRequest("a", prompt(100), 5)])
    (r,) = out.results
    assert r.ok and r.output_tokens == 5
    assert r.ttft_s == pytest.approx(0.2, rel=1e-6)
    assert r.tpot_s == pytest.approx(0.06, rel=1e-6)
    # The worker saves its 6 full blocks (colocated workers save all); the final line waits.
    assert r.e2e_s == pytest.approx(0.2 + 4 * 0.06, rel=1e-6)
    assert out.routes == {"colocated": 1} and out.computed_prompt_tokens == 100


def test_disaggregated_hands_the_prompt_over_through_the_store() -> None:
    out = run(split(), [BenchRequest("a", prompt(100), 4)])
    (r,) = out.results
    assert r.ok and r.output_tokens == 4 and out.routes == {"disaggregated": 1}
    # The first token waits for the 6 full blocks' save (one batch at the prefill's end).
    assert r.ttft_s == pytest.approx(0.2 + 0.001 + 0.002 * 6, rel=1e-6)
    # The decode worker loads the 6 blocks (2 ms + 6 ms), computes the last 4 prompt tokens and
    # the first output (a 5-token chunk: 0.105 s), then decodes two more (0.06 s each).
    assert r.itl_s[0] == pytest.approx(0.008 + 0.1 + 0.005, rel=1e-6)
    assert r.itl_s[1:] == pytest.approx([0.06, 0.06], rel=1e-6)
    assert out.worker_steps["prefill-0"] == 1 and out.worker_steps["decode-0"] == 3


def test_a_shared_prefix_hits_the_device_cache_and_kv_aware_routing_follows_it() -> None:
    shared = prompt(320)
    reqs = [BenchRequest("a", shared + prompt(20, 5000), 2, 0.0),
            BenchRequest("b", prompt(300, 9000), 2, 0.0),
            BenchRequest("c", shared + prompt(20, 7000), 2, 5.0)]
    out = run(colocated(n=1), reqs)
    byid = {r.request_id: r for r in out.results}
    assert byid["c"].cached_tokens == 320 and byid["a"].cached_tokens == 0
    two = split(p=2, d=1)
    sim = SimCluster(two, PROFILES.costs_for)
    res = sim.run_workload(reqs)
    assert all(r.ok for r in res.results)
    # "c" went where "a" was prefilled: its 20 blocks are in that worker's device cache.
    assert res.device_hit_tokens == 320


def test_colocated_balance_spreads_a_shared_prefix_over_the_fleet() -> None:
    """A 1,008-token prefix that the first request leaves in one worker's device cache (no
    store: the other worker could only compute it): the kv-aware choice alone sends the
    requests that share it to that worker until its own queue outweighs the prefix, and its
    decodes pile up; with the router's balance guard the second worker takes its share, the
    busy time is more even and every TPOT lower, at the same device hits."""
    shared = prompt(1008)
    reqs = [BenchRequest(f"r{i}", shared + prompt(20, 5000 + 100 * i), 40, 2.0 + 0.25 * i if i else 0.0)
            for i in range(12)]

    def with_guard(b: Balance):
        cfg = dataclasses.replace(colocated(n=2, num_blocks=4096), balance=b, store_memory_bytes=0)
        return run(cfg, reqs)

    piled, spread = with_guard(Balance(abs_requests=10_000)), with_guard(Balance(abs_requests=2, rel=1.0))
    assert all(r.ok for r in piled.results + spread.results)

    def imbalance(out) -> float:
        return out.worker_busy_s["colocated-0"] / out.worker_busy_s["colocated-1"]

    assert imbalance(piled) > 2.0 and imbalance(spread) < 1.5
    assert max(r.tpot_s for r in spread.results) < min(sorted(r.tpot_s for r in piled.results)[6:])
    assert spread.device_hit_tokens == piled.device_hit_tokens == 10 * 1008  # each worker computed it once


def test_store_is_lru_under_its_capacity() -> None:
    s = SimStore(3)
    s.put([b"a", b"b", b"c"])
    assert s.prefix_len([b"a", b"b", b"x"]) == 2     # touches a and b
    s.put([b"d"])                                    # evicts c, the least recently used
    assert s.peek_prefix_len([b"c"]) == 0 and s.peek_prefix_len([b"a", b"b", b"d"]) == 3
    assert len(s) == 3 and s.evictions == 1
    assert SimStore.of_bytes(parse_bytes("2G"), BLOCK).capacity_blocks == (2 << 30) // (BLOCK + 64)


def test_the_clients_deadline_cancels_what_is_in_flight() -> None:
    reqs = [BenchRequest(f"r{i}", prompt(100, 1000 + 200 * i), 200, 0.1 * i) for i in range(5)]
    out = run(colocated(), reqs, max_duration_s=0.25, grace_s=1.0)
    assert out.not_sent == 2                      # sent at 0.3 and 0.4 s: past the 0.25 s bound
    assert len(out.results) == 3 and all(r.error and "cancelled" in r.error for r in out.results)
    assert out.duration_s == pytest.approx(1.25)


def test_follow_ups_wait_for_the_request_they_follow() -> None:
    reqs = [BenchRequest("t0", prompt(50), 3), BenchRequest("t1", prompt(80), 3, after="t0", delay_s=1.0)]
    out = run(colocated(), reqs)
    r0, r1 = sorted(out.results, key=lambda r: r.request_id)
    assert r1.sent_s == pytest.approx(r0.e2e_s + 1.0)
    assert r1.cached_tokens == 48                 # t0's 3 full blocks


def test_unloaded_probes_and_a_point_give_the_sweeps_figures() -> None:
    cfg = colocated()
    u = unloaded(cfg, PROFILES, SPACE, (64, 16), n=3)
    assert u.ttft_s == pytest.approx(0.164, rel=1e-6) and u.tpot_s == pytest.approx(0.06, rel=1e-6)
    reqs = [BenchRequest(f"r{i}", SPACE.random(__import__("numpy").random.default_rng(i), 64), 16, 0.5 * i)
            for i in range(20)]
    pt = simulate_point(cfg, PROFILES, Workload("w", reqs), u.slo(5, 2), max_duration_s=30, grace_s=10)
    assert pt.summary.completed == 20 and pt.summary.attainment == 1.0
    again = simulate_point(cfg, PROFILES, Workload("w", reqs), u.slo(5, 2), max_duration_s=30, grace_s=10)
    assert again.summary == pt.summary   # deterministic


def test_up_flags_round_trip() -> None:
    c = from_up_flags("x", "--mode colocated --threads-per-worker 2 --colocated-cpus 0,1 "
                           "--worker-arg=--num-blocks=512 --worker-arg=--no-chunked-prefill "
                           "--worker-arg=--max-num-batched-tokens=2048 --store-memory 2G")
    s = c.colocated_spec
    assert (c.mode, c.colocated, s.threads, s.num_blocks, s.enable_chunked_prefill) == ("colocated", 1, 2, 512, False)
    assert c.store_memory_bytes == 2 << 30
    back = from_up_flags("y", c.up_command().split(" ", 2)[2])
    assert back.colocated_spec == s and back.mode == c.mode
    d = from_up_flags("d", "--prefill 2 --decode 3 --worker-arg=--num-blocks=100")
    assert (d.prefill, d.decode, d.decode_spec.num_blocks, d.prefill_spec.role) == (2, 3, 100, "prefill")
    b = from_up_flags("b", "--mode colocated --balance-abs 8 --balance-rel 2")
    assert b.balance == Balance(8, 2.0) and from_up_flags("b", b.up_command().split(" ", 2)[2]).balance == b.balance
    assert "--balance-abs" not in c.up_command()
    with pytest.raises(ValueError):
        ClusterConfig(mode="colocated", colocated=0)


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_kvplan_simulate_and_recommend(tmp_path: Path) -> None:
    prof = pf.save(profile(1), tmp_path / "p1.json")
    pf.save(profile(2), tmp_path / "p2.json")
    common = ["--profile", str(prof), "--profile", str(tmp_path / "p2.json"), "--workload", "mixed",
              "--mixed-long-prompt", "1000", "--no-progress"]
    out = tmp_path / "sim"
    p = subprocess.run([sys.executable, "-m", "planner.cli", "simulate", "--config", "split=--prefill 1 --decode 1",
                        "--config", "colo=--mode colocated --threads-per-worker 2", *common, "--rates", "0.5,2",
                        "--point-seconds", "20", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    assert rec["simulated"] and set(rec["configs"]) == {"split", "colo"}
    assert [pt["rate"] for pt in rec["configs"]["split"]["curve"]] == [0.5, 2.0]
    assert (out / "simulate.json").is_file() and (out / "goodput_vs_rate.png").stat().st_size > 0
    p = subprocess.run([sys.executable, "-m", "planner.cli", "recommend", "--devices", "2", "--chunks", "256",
                        *common, "--out", str(tmp_path / "rec")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    names = [r["name"] for r in rec["ranked"]]
    assert set(names) == {"colo1x2t_chunk256", "colo2x1t_chunk256", "split1p1d_chunk256"}
    assert rec["best"]["name"] in rec["equivalent"] and rec["equivalent"][0] == names[0]
    commands = {r["name"]: r["command"] for r in rec["ranked"]}
    assert commands["split1p1d_chunk256"].startswith("kvrouter up --model default --port 8000 --mode disaggregated")
    assert "kvrouter serve --mode colocated" in commands["colo2x1t_chunk256"]   # up starts one colocated worker
    assert all(math.isfinite(r["capacity_per_device"]) and r["devices"] == 2 for r in rec["ranked"])
    assert rec["hardware"] == "cpu" and rec["fleet"]["threads"] == 1 and rec["objectives"]["tpot"].startswith("2 x")
    assert f"run it: {rec['best']['command']}" in p.stderr
    assert argparse  # (the parser module is exercised through the CLI)


def test_a_request_given_its_prefix_keys_hashes_only_the_rest() -> None:
    from engine.api.generate import SamplingParams
    from engine.core.request import Request
    from kvstore.keys import BlockKey, block_keys

    ns = BlockKey(b"0123456789abcdef")
    toks = list(range(100, 150))
    whole = Request("a", toks, SamplingParams(max_tokens=2), namespace=ns, block_size=16,
                    output_token_ids=[7, 7])
    given = Request("b", toks, SamplingParams(max_tokens=2), namespace=ns, block_size=16,
                    output_token_ids=[7, 7], prefix_keys=block_keys(ns, toks, 16))
    assert given.block_keys == whole.block_keys and len(whole.block_keys) == 3
