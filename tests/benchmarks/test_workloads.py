"""Workload generators: determinism, shapes, trace scaling, shared prefixes, pre-warm split."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from planner.workloads import (
    DEFAULT_TRACE, ChatSpec, MixedSpec, TokenSpace, TraceSpec, block_tokens, poisson_arrivals,
)

REPO = Path(__file__).resolve().parents[2]
SPACE = TokenSpace(vocab_size=1000, token_low=10, max_context=512)


def test_poisson_arrivals_seeded_with_the_right_rate():
    a = poisson_arrivals(4000, 8.0, np.random.default_rng(1))
    assert a == poisson_arrivals(4000, 8.0, np.random.default_rng(1))
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert len(a) / a[-1] == pytest.approx(8.0, rel=0.05)
    assert poisson_arrivals(3, math.inf, np.random.default_rng(1)) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0, np.random.default_rng(1))


def test_mixed_is_deterministic_and_within_the_token_space():
    spec = MixedSpec(short_prompt=32, short_output=16, long_prompt=256, long_output=4, long_share=0.2)
    a, b = spec.build(200, 5.0, 7, SPACE), spec.build(200, 5.0, 7, SPACE)
    assert a.requests == b.requests
    assert a.requests != spec.build(200, 5.0, 8, SPACE).requests
    toks = [t for r in a.requests for t in r.prompt]
    assert min(toks) >= 10 and max(toks) < 1000
    longs = [r for r in a.requests if r.tag == "long"]
    assert 20 <= len(longs) <= 60  # 20% of 200
    assert all(192 <= len(r.prompt) <= 320 and r.max_tokens == 4 for r in longs)
    assert all(24 <= len(r.prompt) <= 40 and r.max_tokens == 16 for r in a.requests if r.tag == "short")


def test_mixed_rate_changes_only_timing_and_dropping_longs_keeps_the_shorts():
    spec = MixedSpec(short_prompt=32, short_output=16, long_prompt=256, long_output=4, long_share=0.2)
    base = spec.build(100, 2.0, 0, SPACE)
    faster = spec.build(100, 4.0, 0, SPACE)
    assert [r.prompt for r in base.requests] == [r.prompt for r in faster.requests]
    assert faster.requests[-1].arrival_s == pytest.approx(base.requests[-1].arrival_s / 2)
    quiet = MixedSpec(**{**spec.__dict__, "include_long": False}).build(100, 2.0, 0, SPACE)
    assert quiet.requests == [r for r in base.requests if r.tag == "short"]
    with pytest.raises(ValueError, match="max_context"):
        MixedSpec(long_prompt=600).build(10, 1.0, 0, SPACE)


def test_chat_turns_share_and_grow_their_history():
    spec = ChatSpec(users=3, turns=4, system_prompt=8, first_message=40, message=20, reply=10, think_time_s=0.5)
    wl = spec.build(2.0, 3, SPACE)
    assert wl.requests == spec.build(2.0, 3, SPACE).requests
    by_id = {r.request_id: r for r in wl.requests}
    assert len(wl.requests) == 12
    system = wl.requests[0].prompt[:8]
    for r in wl.requests:
        assert r.prompt[:8] == system  # shared system prompt
        if r.after is None:
            assert r.tag == "turn0" and r.delay_s == 0.0
        else:
            prev = by_id[r.after]
            assert r.prompt[:len(prev.prompt)] == prev.prompt  # history is a prefix
            assert len(r.prompt) >= len(prev.prompt) + 10 + 15  # + reply + message
            assert r.delay_s > 0 and r.arrival_s == 0.0
    # sessions that would overflow the context end early instead of truncating history
    small = ChatSpec(users=1, turns=10, first_message=200, message=100, reply=50, jitter=0.0).build(1.0, 0, SPACE)
    assert all(len(r.prompt) + r.max_tokens <= 512 for r in small.requests)
    assert len(small.requests) == 2


def write_trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [  # hash ids of 512-token blocks; row 2 shares rows 0's first two blocks
    {"timestamp": 0, "input_length": 1500, "output_length": 64, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 600, "output_length": 10, "hash_ids": [5, 6]},
    {"timestamp": 1000, "input_length": 1100, "output_length": 33, "hash_ids": [0, 1, 9]},
    {"timestamp": 3000, "input_length": 512, "output_length": 1, "hash_ids": [5]},
    {"timestamp": 5000, "input_length": 40000, "output_length": 100, "hash_ids": list(range(100, 179))},
]


def test_trace_scaling_shared_prefixes_and_prewarm(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", ROWS)
    spec = TraceSpec(path=path, start=2, count=3, scale=32, time_scale=2.0, prewarm="shared")
    wl = spec.build(None, 0, SPACE)
    assert wl.requests == spec.build(None, 0, SPACE).requests
    a, b, c = wl.requests
    # lengths / 32 (rounded up), outputs / 32, at least one token
    assert (len(a.prompt), a.max_tokens) == (math.ceil(1100 / 32), 2)
    assert (len(b.prompt), b.max_tokens) == (16, 1)
    # prompt + output cut to the context (512): the cut keeps the prefix
    assert c.max_tokens == 4 and len(c.prompt) == 512 - 4
    assert c.prompt[:16] == block_tokens(0, 100, 16, SPACE)
    # timestamps relative to the window's first, times the scale
    assert [r.arrival_s for r in wl.requests] == pytest.approx([0.0, 4.0, 8.0])
    # the history before the window is the pre-warm set; "shared" keeps rows whose first block
    # is a window request's first block (row 0 via id 0 and row 1 via id 5)
    assert [len(r.prompt) for r in wl.prewarm] == [math.ceil(1500 / 32), math.ceil(600 / 32)]
    assert all(r.max_tokens == 1 for r in wl.prewarm)
    row0 = wl.prewarm[0]
    # equal leading ids give identical token prefixes: 2 shared blocks = 32 tokens
    assert a.prompt[:32] == row0.prompt[:32] and a.prompt[32:34] != row0.prompt[32:34]
    assert b.prompt == wl.prewarm[1].prompt[:16]
    assert wl.scaling["scale"] == 32 and wl.scaling["block_tokens"] == 16
    assert wl.scaling["prompts_cut_to_context"] == 1
    assert len(TraceSpec(path=path, start=2, prewarm="none").build(None, 0, SPACE).prewarm) == 0
    assert len(TraceSpec(path=path, start=3, count=1, prewarm="all").build(None, 0, SPACE).prewarm) == 3
    # a different seed synthesizes different tokens
    assert spec.build(None, 1, SPACE).requests[0].prompt != a.prompt


def test_trace_rate_rescales_time(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", ROWS)
    wl = TraceSpec(path=path, start=0, count=5).build(2.0, 0, SPACE)  # native: 4 gaps in 5 s
    assert wl.requests[-1].arrival_s == pytest.approx(2.0)  # 4 gaps at 2 req/s
    assert wl.scaling["native_rate"] == pytest.approx(0.8)
    with pytest.raises(ValueError):
        TraceSpec(path=path, scale=30).build(None, 0, SPACE)


def test_default_trace_ships_in_the_repository():
    # A fresh clone has everything the benchmarks read: the trace, its licence and its source.
    data = REPO / "planner" / "data"
    assert DEFAULT_TRACE.parent == data and DEFAULT_TRACE.is_file()
    assert "Apache License" in (data / "LICENSE").read_text()
    assert "kvcache-ai/Mooncake" in (data / "README.md").read_text()


def test_nothing_reads_beside_the_repository():
    # a shared/ folder beside the repository (as the trace once was): a clone has none
    beside = re.compile(r"""\.\.["']?\s*/\s*["']?shared""")
    offenders = [str(p.relative_to(REPO)) for d in ("benchmarks", "tests", "scripts", "kvstore", "engine", "router")
                 for p in (REPO / d).rglob("*") if p.suffix in (".py", ".sh", ".toml", ".md") and p.is_file()
                 and beside.search(p.read_text(errors="replace"))]
    assert offenders == []


def test_default_trace_window():
    space = TokenSpace(max_context=2048)
    wl = TraceSpec().build(None, 0, space)
    assert len(wl.requests) == 300 and 0 < len(wl.prewarm) < 1000
    assert all(len(r.prompt) + r.max_tokens <= 2048 for r in wl.requests)
    assert wl.scaling["mean_rate"] == pytest.approx(wl.scaling["native_rate"])
    assert wl.truncate(50).requests == wl.requests[:50]
