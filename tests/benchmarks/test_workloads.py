"""Workload generators: determinism, shapes, trace scaling, shared prefixes, pre-warm split."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from planner.workloads import (
    DEFAULT_TRACE,
    ChatSpec,
    MixedSpec,
    TokenSpace,
    TraceSpec,
    block_tokens,
    load_trace,
    poisson_arrivals,
    shared_prefixes,
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
    # "shared" pre-warms what of the history can hit: a's whole blocks [0, 1] (row 0's third
    # block differs) and b's one block [5] (row 1), in history order, one output token each
    assert [r.request_id for r in wl.prewarm] == ["trace-0-0-prewarm", "trace-0-1-prewarm"]
    assert [len(r.prompt) for r in wl.prewarm] == [32, 16]
    assert all(r.max_tokens == 1 for r in wl.prewarm)
    assert a.prompt[:32] == wl.prewarm[0].prompt and b.prompt == wl.prewarm[1].prompt
    assert wl.scaling["prewarm_requests"] == 2 and wl.scaling["prewarm_tokens"] == 48
    # equal leading ids give identical token prefixes: 2 shared blocks = 32 tokens
    row0 = TraceSpec(path=path, start=2, count=3, prewarm="all").build(None, 0, SPACE).prewarm[0]
    assert len(row0.prompt) == math.ceil(1500 / 32)
    assert a.prompt[:32] == row0.prompt[:32] and a.prompt[32:34] != row0.prompt[32:34]
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


def test_shared_prefixes_are_distinct_longest_runs_in_history_order():
    history = [[1, 2, 3], [1, 2], [4], [1, 2, 3, 8]]
    window = [[1, 2, 9], [1, 2, 3, 7], [4, 5], [6], [1, 2, 3, 7, 7]]
    # [1, 2] (window 0) is a prefix of [1, 2, 3] (windows 1 and 4, once): dropped; [6]: no hit;
    # each run is placed at the last history request holding it (3 for [1, 2, 3])
    assert shared_prefixes(history, window) == [(2, (4,)), (3, (1, 2, 3))]
    assert shared_prefixes(history, [[6], []]) == [] and shared_prefixes([], window) == []


def test_shared_system_prompt_prewarms_a_handful_of_prefixes_not_the_history(tmp_path):
    # Every request starts with block 0 (a common system prompt); every 7th history request
    # also has a second template [1, 2]. Window requests 0-9 use the template, 10-14 continue a
    # history conversation (1500 twice), the rest only share the system prompt.
    hist = [[0, 1, 2, 10_000 + j] if j % 7 == 0 else [0, 10_000 + j, 20_000 + j] for j in range(2000)]
    conts = [100, 500, 1500, 1999, 1500]
    win = ([[0, 1, 2, 30_000 + i] for i in range(10)] + [hist[j] + [40_000 + i] for i, j in enumerate(conts)]
           + [[0, 50_000 + i] for i in range(25)])
    rows = [{"timestamp": 10 * i, "input_length": 512 * len(ids), "output_length": 32, "hash_ids": ids}
            for i, ids in enumerate(hist + win)]
    path = write_trace(tmp_path / "system_prompt.jsonl", rows)
    space = TokenSpace(max_context=2048)
    wl = TraceSpec(path=path, start=2000, count=40, prewarm="shared").build(None, 0, space)
    # first-block matching (the old "shared") sent all 2,000; now: the template, from the last
    # history request with it (1995), and the 4 distinct continued conversations, once each
    assert [r.request_id for r in wl.prewarm] == [f"trace-0-{j}-prewarm" for j in (100, 500, 1500, 1995, 1999)]
    template = tuple(t for h in (0, 1, 2) for t in block_tokens(0, h, 16, space))
    assert wl.prewarm[3].prompt == template
    assert [len(r.prompt) for r in wl.prewarm] == [48, 48, 48, 48, 48]
    assert wl.scaling["prewarm_requests"] == 5 and wl.scaling["prewarm_tokens"] == 240


def test_every_window_request_finds_its_reusable_prefix_prewarmed():
    # The shipped trace's window of docs/benchmarks.md (60 from 1,000): first-block matching
    # sent 10 whole history requests (6,727 tokens); the distinct shared prefixes are 7 (4,144).
    space, scale, block = TokenSpace(max_context=2048), 32, 16
    wl = TraceSpec(start=1000, count=60, scale=scale).build(None, 0, space)
    assert (len(wl.prewarm), wl.scaling["prewarm_tokens"]) == (7, 4144)
    rows = load_trace(DEFAULT_TRACE)
    history, window = rows[:1000], rows[1000:1060]
    assert sum(h["hash_ids"][0] in {w["hash_ids"][0] for w in window} for h in history) == 10
    # brute force over hash ids: the whole blocks a window request shares with some history
    # prompt (that one cut to the context less its one output token) must be pre-warmed
    whole_h = [h["hash_ids"][: min(math.ceil(h["input_length"] / scale), 2047) // block] for h in history]
    reusable = set()
    for w, r in zip(window, wl.requests):
        ids = w["hash_ids"][: len(r.prompt) // block]
        k = max(next((i for i, (x, y) in enumerate(zip(ids, h + [None] * len(ids))) if x != y), len(ids))
                for h in whole_h)
        if k:
            reusable.add(r.prompt[: k * block])
    # each covered, and nothing else sent: every pre-warm prompt is one request's reusable prefix
    assert all(any(p.prompt[: len(x)] == x for p in wl.prewarm) for x in reusable)
    assert {p.prompt for p in wl.prewarm} <= reusable
