"""Scheduler behaviour on tiny specs: budget, decodes first, chunking, preemption, abort, hits.

The model is not involved: each step's sampled tokens are a constant (a fake sampler output),
so what is asserted is exactly the scheduler's plan and its bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from engine.core.block_manager import BlockManager
from engine.core.config import EngineConfig
from engine.core.connector_api import LoadDone
from engine.core.request import LoadTally, Request, RequestStatus
from engine.core.sampling import SamplerOutput, SamplingParams
from engine.core.scheduler import Scheduler, SchedulerOutput
from kvstore.keys import BlockKey, namespace_id

NS = namespace_id({"test": "scheduler"})
BS = 4
EOS = 99


def make(num_blocks: int = 32, **cfg) -> Scheduler:
    config = EngineConfig(num_blocks=num_blocks, block_size=BS, **cfg)
    bm = BlockManager(num_blocks, BS)
    return Scheduler(config, bm, max_model_len=4096, eos_token_ids=[EOS])


def new_request(rid: str, n: int, t: float, max_tokens: int = 8, first: int = 1, **kw) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    return Request(rid, list(range(first, first + n)), params, namespace=NS, block_size=BS,
                    arrival_time=t)


def step(s: Scheduler, token: int = 5) -> SchedulerOutput:
    out = s.schedule()
    n = len(out.sampled_chunks)
    s.postprocess(out, SamplerOutput([token] * n, [None] * n))
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start_pos, c.num_tokens) for c in out.chunks]


def test_chunked_prefill_respects_the_budget() -> None:
    s = make(max_num_batched_tokens=8)
    a = new_request("a", 20, 0.0)
    s.add(a)
    assert plan(step(s)) == [("a", 0, 8)]
    assert a.num_tokens == 20 and a.num_computed_tokens == 8
    assert plan(step(s)) == [("a", 8, 8)]
    out = step(s)
    assert plan(out) == [("a", 16, 4)] and out.sampled_chunks[0].request is a
    assert a.output_token_ids == [5]
    assert plan(step(s)) == [("a", 20, 1)]
    assert a.stats.computed_prompt_tokens == 20
    assert len(a.block_table) == 6  # 22 tokens in 4-token blocks


def test_decodes_come_first_and_prefill_fills_the_rest() -> None:
    s = make(max_num_batched_tokens=8)
    a, b = new_request("a", 3, 0.0), new_request("b", 30, 1.0, first=100)
    s.add(a)
    s.add(b)
    out = step(s)
    assert plan(out) == [("a", 0, 3), ("b", 0, 5)]
    for start in (5, 12, 19, 26):
        out = step(s)
        assert out.chunks[0].request is a and out.chunks[0].num_tokens == 1
        assert out.num_batched_tokens <= 8
        assert plan(out)[1] == ("b", start, min(7, 30 - start))


def test_unchunked_prompt_waits_until_it_fits_whole() -> None:
    s = make(max_num_batched_tokens=16, enable_chunked_prefill=False)
    s.add(new_request("a", 10, 0.0))
    s.add(new_request("b", 10, 1.0, first=100))
    s.add(new_request("c", 2, 2.0, first=200))
    assert plan(step(s)) == [("a", 0, 10)]  # b does not fit the 6 left; c waits behind b (FCFS)
    assert plan(step(s)) == [("a", 10, 1), ("b", 0, 10), ("c", 0, 2)]


def test_max_num_seqs_caps_admission() -> None:
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(new_request(f"r{i}", 4, float(i)))
    out = step(s)
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1"]
    assert len(s.running) == 2 and len(s.waiting) == 1


def test_prefix_cache_hit_skips_full_blocks_but_not_the_last_token() -> None:
    s = make()
    a = new_request("a", 10, 0.0, max_tokens=1)
    s.add(a)
    step(s)
    assert a.is_finished and a.finish_reason == "length"
    assert s.block_manager.num_free_blocks == 32
    b = new_request("b", 10, 1.0)
    s.add(b)
    assert plan(step(s)) == [("b", 8, 2)]
    assert b.stats.device_hit_tokens == 8 and b.stats.computed_prompt_tokens == 2
    c = new_request("c", 8, 2.0)  # exactly two full blocks: the last token must still be computed
    s.add(c)
    out = step(s)
    assert ("c", 4, 4) in plan(out)
    assert c.block_table[0] == b.block_table[0]  # shared head block
    assert s.block_manager.ref_count(c.block_table[0]) == 2


def test_preemption_picks_the_latest_arrival_and_recomputes_it() -> None:
    s = make(num_blocks=4, max_num_batched_tokens=64)
    a, b = new_request("a", 4, 0.0, max_tokens=8), new_request("b", 4, 1.0, max_tokens=8, first=50)
    s.add(a)
    s.add(b)
    preempted: list[Request] = []
    while not preempted:
        out = step(s)
        preempted = out.preempted
    assert preempted == [b]
    assert b.status is RequestStatus.WAITING and s.waiting[0] is b
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.stats.num_preemptions == 1
    assert [c.request for c in out.chunks] == [a]  # nothing admitted in a step that preempted
    while s.has_unfinished():
        step(s)
    assert a.output_token_ids == [5] * 8 and b.output_token_ids == [5] * 8
    assert b.stats.device_hit_tokens > 0  # its full blocks survived in the prefix cache
    assert s.block_manager.num_free_blocks == 4 and s.num_preemptions == 1


def test_abort_frees_everything_and_is_idempotent() -> None:
    s = make(num_blocks=8, max_num_batched_tokens=8)
    a, b, c = new_request("a", 12, 0.0), new_request("b", 3, 1.0), new_request("c", 3, 2.0)
    for x in (a, b, c):
        s.add(x)
    step(s)  # a takes the whole budget; b, c wait
    assert s.abort("a") is a and a.finish_reason == "abort" and a.is_finished
    assert s.abort("c") is c and s.abort("c") is None and s.abort("nope") is None
    assert s.block_manager.num_free_blocks == 8 and a.block_table == []
    assert plan(step(s)) == [("b", 0, 3)]
    assert list(s.waiting) == [] and s.running == [b]


def test_stop_conditions() -> None:
    s = make()
    a, b, c = (new_request("a", 3, 0.0), new_request("b", 3, 1.0, stop_token_ids=(7,), ignore_eos=True),
               new_request("c", 3, 2.0, ignore_eos=True, max_tokens=2))
    for x in (a, b, c):
        s.add(x)
    step(s, token=EOS)
    assert a.finish_reason == "stop" and not b.is_finished and not c.is_finished
    step(s, token=7)
    assert b.finish_reason == "stop" and c.finish_reason == "length"
    assert c.output_token_ids == [EOS, 7]
    assert not s.has_unfinished() and s.block_manager.num_free_blocks == 32


class FakeConnector:
    """A store holding the first ``stored`` blocks of every prompt; loads ``load_ok`` of them.

    Lookups answer at once; a load ends at the next ``finished_loads`` unless ``hold`` is set
    (then it ends once ``release`` is called)."""

    def __init__(self, stored: int, load_ok: int, hold: bool = False) -> None:
        self.stored, self.load_ok, self.hold = stored, load_ok, hold
        self.loads: list[list[int]] = []
        self.saved: list[BlockKey] = []
        self.finished: list[str] = []
        self._in_flight: list[LoadDone] = []
        self._done: list[LoadDone] = []

    def lookup_ahead(self, req: Request) -> None:
        pass

    def get_num_external_hits(self, req: Request, num_device_hit_tokens: int) -> int | None:
        return max(0, self.stored * BS - num_device_hit_tokens)

    def start_load(self, req: Request, block_ids: Sequence[int]) -> None:
        self.loads.append(list(block_ids))
        n = min(self.load_ok, len(block_ids))
        done = LoadDone(req.request_id, LoadTally(n, len(block_ids)))
        (self._in_flight if self.hold else self._done).append(done)

    def release(self) -> None:
        self._done += self._in_flight
        self._in_flight = []

    def finished_loads(self) -> list[LoadDone]:
        out, self._done = self._done, []
        return out

    def wait(self, timeout: float) -> None:
        pass

    def save(self, req: Request, block_ids: Sequence[int], keys: Sequence[BlockKey],
             held: bool = False) -> None:
        assert [req.block_keys.index(k) for k in keys] == [req.block_table.index(b) for b in block_ids]
        self.saved.extend(keys)

    def request_finished(self, req: Request) -> None:
        self.finished.append(req.request_id)


def with_connector(conn: FakeConnector, **cfg) -> Scheduler:
    config = EngineConfig(num_blocks=32, block_size=BS, **cfg)
    return Scheduler(config, BlockManager(32, BS), max_model_len=4096, connector=conn)


def test_external_hits_are_loaded_and_only_new_blocks_are_offered() -> None:
    conn = FakeConnector(stored=8, load_ok=8)
    s = with_connector(conn)
    a = new_request("a", 18, 0.0, max_tokens=4)
    s.add(a)
    assert plan(step(s)) == [] and a.status is RequestStatus.WAITING_FOR_KV  # loading
    assert plan(step(s)) == [("a", 16, 2)]  # 4 blocks loaded (capped: the store had 8)
    assert conn.loads == [a.block_table[:4]] and a.stats.store_hit_tokens == 16
    assert conn.saved == []
    assert s.block_manager.lookup(a.block_keys) == a.block_table[:4]  # loaded blocks are cached
    while s.has_unfinished():
        step(s)
    assert conn.saved == [a.block_keys[4]]  # 22 tokens computed: block 4 filled by decode
    assert conn.finished == ["a"]


def test_a_short_load_is_recomputed_and_offered() -> None:
    conn = FakeConnector(stored=4, load_ok=1)
    s = with_connector(conn)
    a = new_request("a", 18, 0.0, max_tokens=1)
    s.add(a)
    step(s)
    assert plan(step(s)) == [("a", 4, 14)]
    assert a.stats.store_hit_tokens == 4 and a.stats.computed_prompt_tokens == 14
    assert conn.saved == a.block_keys[1:4]
    # A second request hits the device cache; those blocks are offered, none twice within it.
    conn.saved.clear()
    b = new_request("b", 18, 1.0, max_tokens=1)
    s.add(b)
    assert plan(step(s)) == [("b", 16, 2)]
    assert b.stats.device_hit_tokens == 16 and conn.saved == b.block_keys[:4]


@pytest.mark.parametrize("chunked", [True, False])
def test_budget_is_never_exceeded_under_load(chunked: bool) -> None:
    s = make(num_blocks=24, max_num_batched_tokens=16, max_num_seqs=4, enable_chunked_prefill=chunked)
    for i in range(10):
        s.add(new_request(f"r{i}", 3 + (i * 5) % 13, float(i), max_tokens=3 + i % 4))
    steps = 0
    while s.has_unfinished():
        out = step(s)
        assert 0 < out.num_batched_tokens <= 16
        assert len(s.running) <= 4
        steps += 1
        assert steps < 500
    assert s.block_manager.num_free_blocks == 24


class CountingConnector(FakeConnector):
    """A FakeConnector that counts its store lookups (one ``get_num_external_hits`` = one RPC)."""

    def __init__(self, stored: int, load_ok: int) -> None:
        super().__init__(stored, load_ok)
        self.lookups: list[tuple[str, int]] = []

    def get_num_external_hits(self, req: Request, num_device_hit_tokens: int) -> int | None:
        self.lookups.append((req.request_id, num_device_hit_tokens))
        return super().get_num_external_hits(req, num_device_hit_tokens)


def test_a_request_waiting_for_blocks_costs_no_store_lookup() -> None:
    conn = CountingConnector(stored=0, load_ok=0)
    config = EngineConfig(num_blocks=8, block_size=BS)
    s = Scheduler(config, BlockManager(8, BS), max_model_len=4096, connector=conn)
    a = new_request("a", 24, 0.0, max_tokens=5, first=1)     # 6 blocks, then a 7th
    b = new_request("b", 12, 1.0, max_tokens=1, first=100)   # 3 blocks: waits for a
    s.add(a)
    step(s)
    s.add(b)
    assert conn.lookups == [("a", 0)]
    for _ in range(4):  # a decodes; 2 (then 1) free blocks never fit b's 3
        assert plan(step(s))[0][0] == "a" and b.status is RequestStatus.WAITING
    assert conn.lookups == [("a", 0)]  # b does not fit without store hits: the store is not asked
    while s.has_unfinished():
        step(s)
    assert conn.lookups == [("a", 0), ("b", 0)]


def test_a_waiting_request_asks_the_store_once_while_it_waits() -> None:
    # b's store hits make its first chunk larger than the blocks free, so it waits after asking.
    conn = CountingConnector(stored=2, load_ok=2)
    config = EngineConfig(num_blocks=8, block_size=BS, max_num_batched_tokens=4)
    s = Scheduler(config, BlockManager(8, BS), max_model_len=4096, connector=conn)
    a = new_request("a", 20, 0.0, max_tokens=3, first=1)   # 5 blocks (2 from the store), a 6th at 21
    s.add(a)
    while a.num_computed_tokens < a.num_tokens - 1 or a.is_prefill:
        step(s)
    b = new_request("b", 12, 1.0, max_tokens=1, first=100)
    s.add(b)
    # 2 free; b without hits needs 1 block for a 3-token chunk, with 8 hit tokens 3 blocks for 11.
    for _ in range(2):
        out = step(s)
        assert [c.request for c in out.chunks] == [a] and b.status is RequestStatus.WAITING
    assert [x for x in conn.lookups if x[0] == "b"] == [("b", 0)]  # asked once, then remembered
    while s.has_unfinished():
        step(s)
    assert [x for x in conn.lookups if x[0] == "b"] == [("b", 0)]
    assert b.stats.store_hit_tokens == 8


def test_a_preempted_request_asks_the_store_again() -> None:
    conn = CountingConnector(stored=1, load_ok=1)
    config = EngineConfig(num_blocks=6, block_size=BS)
    s = Scheduler(config, BlockManager(6, BS), max_model_len=4096, connector=conn)
    a = new_request("a", 7, 0.0, max_tokens=8, first=1)
    b = new_request("b", 7, 1.0, max_tokens=8, first=50)
    s.add(a)
    s.add(b)
    while b.stats.num_preemptions == 0:
        step(s)
        assert s.has_unfinished()
    assert [x for x in conn.lookups if x[0] == "b"] == [("b", 0)]
    while b.status is RequestStatus.WAITING:
        step(s)
    # Asked again once it fits, after its own 2 blocks (now device hits) for the rest.
    assert [x for x in conn.lookups if x[0] == "b"] == [("b", 0), ("b", 8)]


# --- loads off the step: a request waits for its KV while the others run -----------------------


def test_running_requests_keep_stepping_while_a_load_is_in_flight() -> None:
    conn = FakeConnector(stored=0, load_ok=4, hold=True)
    s = with_connector(conn)
    a = new_request("a", 5, 0.0, max_tokens=20)
    s.add(a)
    step(s)
    conn.stored = 4
    b = new_request("b", 18, 1.0, max_tokens=2, first=40)
    s.add(b)
    for _ in range(5):   # b's load is held: a gets a token every step regardless
        pos = a.num_tokens - 1
        assert plan(step(s)) == [("a", pos, 1)]
        assert b.status is RequestStatus.WAITING_FOR_KV and s.io_waits == 1
    held = set(b.block_table[:4])
    assert conn.loads == [b.block_table[:4]] and not held & set(a.block_table)
    conn.release()
    pos = a.num_tokens - 1
    assert plan(step(s)) == [("a", pos, 1), ("b", 16, 2)]
    assert b.stats.store_hit_tokens == 16 and b.kv.load.loaded == 4


def test_an_abort_during_a_load_holds_its_blocks_until_the_load_ends() -> None:
    conn = FakeConnector(stored=4, load_ok=4, hold=True)
    s = with_connector(conn)
    b = new_request("b", 18, 0.0, max_tokens=2)
    s.add(b)
    step(s)
    targets = list(conn.loads[0])
    free_before = s.block_manager.num_free_blocks
    s.abort("b")
    assert b.finish_reason == "abort" and conn.finished == ["b"] and not s.has_unfinished()
    # The loader may still write its 4 target blocks: only b's other block came back.
    assert s.block_manager.num_free_blocks == free_before + 1
    assert all(s.block_manager.ref_count(x) == 1 for x in targets)
    assert s.blocks_held_by_abandoned_loads == 4
    c = new_request("c", 60, 1.0, max_tokens=1, first=200)   # wants every free block
    s.add(c)
    step(s)
    assert not set(targets) & set(c.block_table)
    conn.release()
    step(s)
    assert s.blocks_held_by_abandoned_loads == 0
    assert all(s.block_manager.ref_count(x) == 0 for x in targets)


def test_a_preemption_during_a_load_never_takes_the_loading_blocks() -> None:
    conn = FakeConnector(stored=0, load_ok=2, hold=True)
    config = EngineConfig(num_blocks=8, block_size=BS)
    s = Scheduler(config, BlockManager(8, BS), max_model_len=4096, connector=conn)
    a = new_request("a", 7, 0.0, max_tokens=12, first=1)      # grows to 5 blocks
    s.add(a)
    step(s)
    conn.stored = 2
    b = new_request("b", 10, 1.0, max_tokens=2, first=50)     # 2 blocks loading + 1
    s.add(b)
    c = new_request("c", 3, 2.0, max_tokens=12, first=90)     # runs beside a; preempted
    step(s)
    s.add(c)
    assert b.status is RequestStatus.WAITING_FOR_KV
    targets = set(conn.loads[0])
    while c.stats.num_preemptions == 0:
        step(s)
        assert targets <= set(b.block_table) and not targets & set(a.block_table + c.block_table)
    assert b.status is RequestStatus.WAITING_FOR_KV   # never a victim
    conn.release()
    while s.has_unfinished():
        step(s)
    assert b.stats.store_hit_tokens == 8 and s.block_manager.num_free_blocks == 8


def test_a_load_past_its_deadline_is_abandoned_and_its_request_computes(monkeypatch) -> None:
    conn = FakeConnector(stored=4, load_ok=4, hold=True)
    s = with_connector(conn, kv_load_timeout_s=0.05)
    b = new_request("b", 18, 0.0, max_tokens=2)
    s.add(b)
    step(s)
    targets = list(conn.loads[0])
    import time as _time
    _time.sleep(0.06)
    out = step(s)   # past the deadline: back to waiting, then admitted to compute it all
    assert plan(out) == [("b", 0, 18)] and b.kv.store_failed and s.num_abandoned_loads == 1
    assert not set(targets) & set(b.block_table) and s.blocks_held_by_abandoned_loads == 4
    while s.has_unfinished():
        step(s)
    assert b.stats.store_hit_tokens == 0 and b.stats.computed_prompt_tokens == 18
    assert len(conn.loads) == 1   # never asked the store again
    conn.release()
    step(s)
    assert s.blocks_held_by_abandoned_loads == 0 and s.block_manager.num_free_blocks == 32


def test_the_same_prefix_twice_loads_once_and_the_second_hits_the_device() -> None:
    conn = FakeConnector(stored=4, load_ok=4, hold=True)
    s = with_connector(conn)
    a = new_request("a", 18, 0.0, max_tokens=2)
    b = new_request("b", 18, 1.0, max_tokens=2)
    s.add(a)
    s.add(b)
    for _ in range(3):
        assert plan(step(s)) == []
        assert a.status is RequestStatus.WAITING_FOR_KV and b.status is RequestStatus.WAITING
    conn.release()
    assert plan(step(s)) == [("a", 16, 2), ("b", 16, 2)]
    assert len(conn.loads) == 1
    assert a.stats.store_hit_tokens == 16 and b.stats.device_hit_tokens == 16


class SlowLookup(FakeConnector):
    """Answers a request's lookup only from the step after it was first asked."""

    def __init__(self, stored: int) -> None:
        super().__init__(stored, load_ok=stored)
        self.asked: set[str] = set()

    def get_num_external_hits(self, req: Request, num_device_hit_tokens: int) -> int | None:
        if req.request_id not in self.asked:
            self.asked.add(req.request_id)
            return None
        return super().get_num_external_hits(req, num_device_hit_tokens)


def test_a_request_whose_lookup_is_pending_lets_the_next_one_go_first() -> None:
    conn = SlowLookup(stored=0)
    s = with_connector(conn)
    a = new_request("a", 6, 0.0, max_tokens=1)
    s.add(a)
    assert plan(step(s)) == [] and s.io_waits == 1
    b = new_request("b", 5, 1.0, max_tokens=1, first=30)
    s.add(b)
    # a has its answer now; b's is pending: a computes, b waits its turn behind no one.
    assert plan(step(s)) == [("a", 0, 6)] and b.status is RequestStatus.WAITING
    assert plan(step(s)) == [("b", 0, 5)]


def test_a_request_the_device_covers_is_not_kept_waiting_for_a_lookup() -> None:
    conn = SlowLookup(stored=0)
    s = with_connector(conn)
    a = new_request("a", 17, 0.0, max_tokens=1)
    s.add(a)
    while s.has_unfinished():
        step(s)
    b = new_request("b", 17, 1.0, max_tokens=1)   # its 4 usable blocks are device hits
    s.add(b)
    assert plan(step(s)) == [("b", 16, 1)] and "b" not in conn.asked
