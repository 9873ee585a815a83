"""KvIndex: ordered events, gaps and resync, longest leading match per worker."""

from __future__ import annotations

import time

from engine.api.events import BlockEvent, LoadEvent, LoadFigures, Snapshot
from kvstore.keys import block_keys
from router.workers.kv_index import KvIndex

NS = bytes(16)


def _keys(tokens: list[int]):
    return block_keys(NS, tokens, 4)


PROMPT = list(range(40))  # 10 blocks of 4
KEYS = _keys(PROMPT)


def _synced(index: KvIndex, wid: str, blocks=(), seq: int = 0) -> None:
    index.reset(wid, Snapshot(seq, tuple(blocks), LoadFigures()))


def test_match_counts_leading_blocks_per_worker() -> None:
    index = KvIndex()
    _synced(index, "a", KEYS[:6])
    _synced(index, "b", KEYS[:2] + KEYS[3:])   # a hole at block 2: only 2 leading blocks count
    _synced(index, "c")
    other = _keys([9] + PROMPT[1:])             # a different first token changes every key
    assert index.match(KEYS) == {"a": 6, "b": 2, "c": 0}
    assert index.match(other) == {"a": 0, "b": 0, "c": 0}
    assert index.match(KEYS, ["b", "zz"]) == {"b": 2, "zz": 0}
    assert index.match([]) == {"a": 0, "b": 0, "c": 0}
    assert sorted(index.holders(KEYS[0])) == ["a", "b"]


def test_events_apply_in_order_and_gaps_ask_for_resync() -> None:
    index = KvIndex()
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


def test_remove_worker_clears_bits_and_reuses_slot() -> None:
    index = KvIndex()
    _synced(index, "a", KEYS)
    _synced(index, "b", KEYS[:5])
    index.remove_worker("a")
    assert index.match(KEYS) == {"b": 5} and len(index) == 5
    _synced(index, "c", KEYS[:1])
    assert index.match(KEYS) == {"b": 5, "c": 1}
    index.remove_worker("b")
    index.remove_worker("b")
    assert index.match(KEYS) == {"c": 1} and len(index) == 1


def test_match_is_fast_on_a_large_index() -> None:
    index = KvIndex()
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
