"""``kvrouter up --autoscale`` in the simulator (planner.sim.autoscale): the router's own scaling
code and the launcher's own plan on the virtual clock, on the synthetic profile of test_sim
(a decode step 0.05 s + 0.01 s a sequence; a prefill 0.1 s + 1 ms a token)."""

from __future__ import annotations

import dataclasses

from planner.sim.autoscale import SimAutoscale
from planner.sim.cluster import SimCluster
from planner.sim.config import from_up_flags
from planner.sim.worker import SimWorker
from planner.workloads import BenchRequest
from router.scaling.policy import ScalingConfig
from tests.planner.test_sim import PROFILES, prompt

# Decodes always over their objective, prefills never; more at once, fewer after 5 s (a fresh
# cluster is not cut before its load arrives). The policy itself is tested in
# tests/router/test_autoscale_policy.py, here what the simulator does with its answers.
EAGER = ScalingConfig(ttft_target_s=1000, itl_target_s=1e-4, up_for_s=0, down_for_s=5, cooldown_s=0,
                      window_s=2, interval_s=0.5, prefill_share_target=0.9)


def _flags(layout: str, **scale: float) -> str:
    extra = " ".join(f"--scale-{k.replace('_', '-')} {v}" for k, v in scale.items())
    return f"--autoscale --max-workers 2 --autoscale-interval 0.5 {layout} --worker-arg=--num-blocks=256 {extra}"


def _submissions(monkeypatch) -> list[tuple[str, float, str]]:
    """(worker, time, phase) of every phase a worker is given."""
    seen: list[tuple[str, float, str]] = []
    original = SimWorker.submit

    def submit(self, t, choice, phase, *a, **kw):
        seen.append((self.worker_id, t, phase))
        return original(self, t, choice, phase, *a, **kw)

    monkeypatch.setattr(SimWorker, "submit", submit)
    return seen


def _phases(monkeypatch) -> dict[tuple[str, str, str], list[float]]:
    """(worker, request, phase) -> [given at, finished at]."""
    out: dict[tuple[str, str, str], list[float]] = {}
    submit, finish = SimWorker.submit, SimWorker._finish

    def on_submit(self, t, choice, phase, *a, **kw):
        out[(self.worker_id, choice.request_id, phase)] = [t]
        return submit(self, t, choice, phase, *a, **kw)

    def on_finish(self, st, t):
        out[(self.worker_id, st.choice.request_id, st.phase)].append(t)
        return finish(self, st, t)

    monkeypatch.setattr(SimWorker, "submit", on_submit)
    monkeypatch.setattr(SimWorker, "_finish", on_finish)
    return out


def test_up_flags_carry_the_autoscaler_and_default_to_auto_mode() -> None:
    cfg = from_up_flags("a", _flags("--prefill 1 --decode 1", itl_target=0.2, up_for=3))
    assert cfg.mode == "auto" and cfg.autoscale is not None
    assert cfg.autoscale.max_workers == 2 and cfg.autoscale.interval_s == 0.5
    assert cfg.autoscale.scaling.itl_target_s == 0.2 and cfg.autoscale.scaling.up_for_s == 3
    assert cfg.autoscale.scaling.cooldown_s == ScalingConfig().cooldown_s
    assert "autoscaled within 2" in cfg.label()
    again = from_up_flags("a", cfg.up_command())   # the command it prints starts the same autoscaler
    assert again.autoscale == cfg.autoscale and again.mode == "auto"
    assert from_up_flags("b", "--prefill 1 --decode 1").autoscale is None


def test_an_idle_prefill_worker_becomes_a_decode_worker_and_takes_decodes(monkeypatch) -> None:
    seen = _submissions(monkeypatch)
    cfg = dataclasses.replace(from_up_flags("a", _flags("--prefill 1 --decode 1")),
                              autoscale=SimAutoscale(EAGER, max_workers=2, interval_s=0.5))
    cluster = SimCluster(cfg, PROFILES.costs_for)
    reqs = [BenchRequest(f"r{i}", prompt(24, 1000 * i), 300, arrival_s=0.5 * i) for i in range(24)]
    run = cluster.run_workload(reqs)
    assert all(r.ok for r in run.results) and len(run.results) == 24
    acts = [a for a in cluster.autoscaler.timeline if a["kind"] == "action"]
    assert acts and acts[0]["action"] == "role" and acts[0]["worker"] == "prefill-0"
    assert acts[0]["layout_after"] == "colocated x2"
    assert cluster.workers["prefill-0"].spec.role == "decode"
    # In its new role it serves whole requests (auto mode with no prefill pool).
    assert any(w == "prefill-0" and phase == "full" and t > acts[0]["t"] for w, t, phase in seen)
    assert all(s["prefill"] + s["decode"] <= 2 for s in cluster.autoscaler.timeline if s["kind"] == "signals")


def test_a_role_change_drains_the_worker_first(monkeypatch) -> None:
    # Colocated x2 with huge prompts: prefill takes the decode workers' time while their decodes
    # miss, so a prefill pool is split off: one worker, running decodes, changes its role. From
    # the moment it drains until its change it is given nothing, and the change waits until
    # every phase it held is done.
    phases = _phases(monkeypatch)
    cfg = dataclasses.replace(from_up_flags("a", _flags("--prefill 0 --decode 2")),
                              autoscale=SimAutoscale(dataclasses.replace(EAGER, prefill_share_target=1e-6),
                                                     max_workers=2, interval_s=0.5))
    cluster = SimCluster(cfg, PROFILES.costs_for)
    reqs = [BenchRequest(f"s{i}", prompt(24, 1000 * i), 200, arrival_s=0.2 * i) for i in range(6)]
    reqs += [BenchRequest(f"h{i}", prompt(600, 50_000 + 1000 * i), 4, arrival_s=2.0 + 1.5 * i) for i in range(20)]
    run = cluster.run_workload(reqs)
    assert all(r.ok for r in run.results)
    role = next(a for a in cluster.autoscaler.timeline if a["kind"] == "action" and a["action"] == "role")
    assert role["to"] == "prefill" and role["layout_after"] == "1P+1D"
    wid, t0, t1 = role["worker"], role["started"], role["t"]
    assert t1 - t0 >= 1.0   # the settle, at least
    held = [(k, v) for k, v in phases.items() if k[0] == wid and v[0] < t0 < v[1]]
    assert held, "the worker was running phases when its drain began"
    assert all(v[1] <= t1 for _k, v in held), "the change waited for them"
    assert not [k for k, v in phases.items() if k[0] == wid and t0 <= v[0] < t1], "nothing new while draining"
    assert any(k[0] == wid and k[2] == "prefill" and v[0] >= t1 for k, v in phases.items()), "then prefills"
