"""planner.recommend.workload_from_log: a router request log (its ``prefill_stats`` and
``decode_stats``, the worker's names) as a workload."""

from __future__ import annotations

import json
from pathlib import Path

from planner.recommend import workload_from_log
from planner.workloads import TokenSpace


def _record(i: int, prompt: int, prefill: dict[str, int], decode: dict[str, int]) -> dict:
    return {"request_id": f"r{i}", "status": "ok", "prompt_tokens": prompt, "output_tokens": 4,
            "arrival_unix": 1000.0 + i, "prefill_stats": prefill, "decode_stats": decode}


def test_a_prompt_served_from_a_cache_shares_that_many_leading_tokens(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    rows = [_record(0, 40, {}, {}),
            _record(1, 40, {"device_hit_tokens": 16, "store_hit_tokens": 16}, {"store_hit_tokens": 32}),
            _record(2, 40, {}, {"device_hit_tokens": 16})]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second, third = (r.prompt for r in workload_from_log(log, TokenSpace()).requests)
    # The prefill side's hits, and the device hits of every phase (the decode side's store
    # loads are the handoff, not a hit).
    assert second[:32] == first[:32] and second[32] != first[32]
    assert third[:16] == second[:16] and third[16] != second[16]
    assert [r.arrival_s for r in workload_from_log(log, TokenSpace()).requests] == [0.0, 1.0, 2.0]
