"""KvIndex: ordered events, gaps and resync, longest leading match per worker; every case on
the native table and on the Python dict, and the two driven side by side."""

from __future__ import annotations

import random
import time

import pytest

from engine.api.events import BlockEvent, LoadEvent, LoadFigures, Snapshot
from kvstore.keys import block_keys
from router.workers.kv_index import NATIVE_SLOTS, KvIndex
from router.workers.kv_native import native_status, table_type

NS = bytes(16)


def _keys(tokens: list[int]):
    return block_keys(NS, tokens, 4)


PROMPT = list(range(40))  # 10 blocks of 4
KEYS = _keys(PROMPT)


def _native_or_skip() -> None:
    from tests.native import require_native

    require_native(table_type() is not None, "the native index table", native_status())


@pytest.fixture(params=["native", "python"])
def new_index(request):
    """A KvIndex factory on the native table or on the Python dict."""
    if request.param == "native":
        _native_or_skip()

    def make() -> KvIndex:
        index = KvIndex(native=request.param == "native")
        assert index.backend == request.param
        return index

    return make


def _synced(index: KvIndex, wid: str, blocks=(), seq: int = 0) -> None:
    index.reset(wid, Snapshot(seq, tuple(blocks), LoadFigures()))


def test_match_counts_leading_blocks_per_worker(new_index) -> None:
    index = new_index()
    _synced(index, "a", KEYS[:6])
    _synced(index, "b", KEYS[:2] + KEYS[3:])   # a hole at block 2: only 2 leading blocks count
    _synced(index, "c")
    other = _keys([9] + PROMPT[1:])             # a different first token changes every key
    assert index.match(KEYS) == {"a": 6, "b": 2, "c": 0}
    assert index.match(other) == {"a": 0, "b": 0, "c": 0}
    assert index.match(KEYS, ["b", "zz"]) == {"b": 2, "zz": 0}
    assert index.match(KEYS, ["zz", "c", "b", "a", "b"]) == {"zz": 0, "c": 0, "b": 2, "a": 6}
    assert index.match(KEYS, ("a",)) == {"a": 6} and index.match(KEYS, []) == {}
    assert index.match(other, ["a", "b"]) == {"a": 0, "b": 0} and index.match([], ["a"]) == {"a": 0}
    assert index.match([]) == {"a": 0, "b": 0, "c": 0}
    assert sorted(index.holders(KEYS[0])) == ["a", "b"]


def test_events_apply_in_order_and_gaps_ask_for_resync(new_index) -> None:
    index = new_index()
    index.add_worker("w")
    # Unsynced until the first snapshot: events are refused.
    assert not index.apply("w", BlockEvent(1, "stored", tuple(KEYS[:3])))
    _synced(index, "w", seq=5)
    assert index.apply("w", BlockEvent(6, "stored", tuple(KEYS[:4])))
    assert index.apply("w", LoadEvent(7, LoadFigures(waiting=1)))
    assert index.apply("w", BlockEvent(8, "removed", (KEYS[3],)))
    assert index.match(KEYS) == {"w": 3}
    assert index.apply("w", BlockEvent(8, "removed", (KEYS[0],)))  # duplicate: ignored
    assert index.match(KEYS) == {"w": 3} and index.last_seq("w") == 8
    # A gap (9 missing) makes the worker unsynced; its old blocks stay as a hint.
    assert not index.apply("w", BlockEvent(10, "stored", (KEYS[3],)))
    assert not index.is_synced("w") and index.last_seq("w") is None
    assert not index.apply("w", BlockEvent(11, "stored", (KEYS[4],)))
    assert index.match(KEYS) == {"w": 3}
    # The snapshot replaces everything.
    _synced(index, "w", KEYS[:8], seq=11)
    assert index.match(KEYS) == {"w": 8} and index.num_blocks("w") == 8
    _synced(index, "w", KEYS[5:], seq=12)
    assert index.match(KEYS) == {"w": 0} and len(index) == 5


def test_remove_worker_clears_bits_and_reuses_slot(new_index) -> None:
    index = new_index()
    _synced(index, "a", KEYS)
    _synced(index, "b", KEYS[:5])
    index.remove_worker("a")
    assert index.match(KEYS) == {"b": 5} and len(index) == 5
    _synced(index, "c", KEYS[:1])
    assert index.match(KEYS) == {"b": 5, "c": 1}
    index.remove_worker("b")
    index.remove_worker("b")
    assert index.match(KEYS) == {"c": 1} and len(index) == 1


def test_match_is_fast_on_a_large_index(new_index) -> None:
    index = new_index()
    block_size, n_workers = 16, 8
    prompts = [[w * 100_000 + i for i in range(8192)] for w in range(n_workers)]
    all_keys = [block_keys(NS, p, block_size) for p in prompts]   # 512 blocks each
    for w, keys in enumerate(all_keys):
        _synced(index, f"w{w}", keys)
    for w in range(n_workers):                     # fill to ~100k blocks of other content
        filler = [bytes([w]) + i.to_bytes(15, "little") for i in range(12_000)]
        index.apply(f"w{w}", BlockEvent(1, "stored", tuple(filler)))  # plain bytes work too
    assert len(index) > 100_000
    query = all_keys[3]
    start = time.perf_counter()
    for _ in range(50):
        result = index.match(query)
    per_call = (time.perf_counter() - start) / 50
    assert result["w3"] == 512 and result["w0"] == 0
    assert per_call < 0.005, f"match took {per_call * 1e3:.2f} ms"


def _same(a: KvIndex, b: KvIndex, queries: list[list[bytes]], rng: random.Random) -> None:
    assert len(a) == len(b) and sorted(a.workers) == sorted(b.workers)
    for wid in a.workers:
        assert a.num_blocks(wid) == b.num_blocks(wid)
        assert a.is_synced(wid) == b.is_synced(wid) and a.last_seq(wid) == b.last_seq(wid)
    for q in queries:
        q = q[: rng.randint(0, len(q))]
        assert a.match(q) == b.match(q)
        assert a.match(tuple(q)) == b.match(tuple(q))
        some = rng.sample(a.workers, rng.randint(0, len(a.workers))) + ["nobody"]
        assert a.match(q, some) == b.match(q, some)
        assert set(a.match(q, some)) == set(some)         # every worker asked about, once
        if q:
            k = rng.choice(q)
            assert sorted(a.holders(k)) == sorted(b.holders(k))


def test_native_and_python_agree_under_random_events() -> None:
    """One seeded stream of snapshots, events (with duplicates and gaps), joins and leaves,
    on both tables at once: every match, holder list and count agrees. Enough keys come and
    go that the native table grows, shrinks and moves entries back on deletion many times."""
    _native_or_skip()
    rng = random.Random(12)
    native, python = KvIndex(native=True), KvIndex(native=False)
    both = (native, python)
    # Chains of prompt keys (prefixes shared between chains), plus structured filler keys.
    chains = [block_keys(NS, [c % 7] * 64 + list(range(c, c + 4 * rng.randint(1, 300))), 4)
              for c in range(40)]
    filler = [i.to_bytes(16, "little") for i in range(20_000)]
    seqs: dict[str, int] = {}
    for step in range(400):
        op = rng.random()
        wid = f"w{rng.randint(0, 11)}"
        if op < 0.08 or wid not in seqs:
            blocks = tuple(rng.choice(chains)[: rng.randint(0, 400)])
            seqs[wid] = rng.randint(0, 5)
            for ix in both:
                ix.reset(wid, Snapshot(seqs[wid], blocks, LoadFigures()))
        elif op < 0.12:
            for ix in both:
                ix.remove_worker(wid)
            del seqs[wid]
        else:
            kind = "stored" if rng.random() < 0.6 else "removed"
            if rng.random() < 0.5:
                pool = rng.choice(chains)
                lo = rng.randint(0, len(pool))
                keys = pool[lo: lo + rng.randint(1, 200)]
            else:
                lo = rng.randint(0, len(filler) - 1)
                keys = filler[lo: lo + rng.randint(1, 3000)]
            r = rng.random()
            seq = seqs[wid] + (1 if r < 0.9 else 0 if r < 0.95 else 2)  # duplicates and gaps
            got = {ix.apply(wid, BlockEvent(seq, kind, tuple(keys))) for ix in both}
            assert len(got) == 1
            if seq == seqs[wid] + 1 and got == {True}:
                seqs[wid] = seq
            elif seq > seqs[wid] + 1:
                seqs[wid] = seq - 1          # the caller resyncs from a snapshot
                snap = Snapshot(seq - 1, tuple(rng.choice(chains)), LoadFigures())
                for ix in both:
                    assert not ix.is_synced(wid)
                    ix.reset(wid, snap)
        if step % 20 == 0:
            _same(native, python, chains, rng)
    _same(native, python, chains, rng)
    assert native.backend == "native"


def test_native_moves_to_python_past_64_workers_and_on_odd_keys() -> None:
    _native_or_skip()
    index, ref = KvIndex(native=True), KvIndex(native=False)
    for i in range(NATIVE_SLOTS):
        for ix in (index, ref):
            _synced(ix, f"w{i}", KEYS[: i % 11])
    assert index.backend == "native" and index.match(KEYS) == ref.match(KEYS)
    for ix in (index, ref):
        _synced(ix, "one-too-many", KEYS[:7])
    assert index.backend == "python" and index.match(KEYS) == ref.match(KEYS)
    assert index.match(KEYS)["one-too-many"] == 7 and len(index) == len(ref) == 10

    odd = KvIndex(native=True)
    _synced(odd, "a", KEYS[:4])
    assert odd.apply("a", BlockEvent(1, "stored", (b"short",) + tuple(KEYS[4:6])))
    assert odd.backend == "python"
    assert odd.match(KEYS) == {"a": 6} and len(odd) == 7 and odd.holders(b"short") == ["a"]


def test_native_required_but_disabled(monkeypatch) -> None:
    import router.workers.kv_index as kv_index

    monkeypatch.setattr(kv_index, "table_type", lambda: None)
    assert KvIndex().backend == "python"
    with pytest.raises(RuntimeError):
        KvIndex(native=True)
