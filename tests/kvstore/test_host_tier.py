"""The host index: exact LRU over evictable entries, pins, owners, deferred deletes."""

from __future__ import annotations

import pytest

from kvstore.keys import BlockKey
from kvstore.node.host_tier import EntryState, HostIndex


def K(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def _committed(idx: HostIndex, *ids: int):
    out = []
    for i in ids:
        e = idx.reserve(K(i), 1000, owner=None)
        idx.commit(e, checksum=i)
        out.append(e)
    return out


def test_lru_holds_exactly_the_committed_unpinned_entries_in_use_order():
    idx = HostIndex(1 << 20)
    a, b, c = _committed(idx, 1, 2, 3)
    pending = idx.reserve(K(4), 1000, owner="w")
    assert pending.state is EntryState.RESERVED
    assert idx.lru_keys() == [K(1), K(2), K(3)]
    idx.pin(a, owner="r")
    assert idx.lru_keys() == [K(2), K(3)]
    idx.unpin(a, owner="r")
    assert idx.lru_keys() == [K(2), K(3), K(1)]
    assert idx.pop_lru() is b
    idx.remove(b)
    assert K(2) not in idx and idx.committed_blocks == 2 and idx.value_bytes == 2000


def test_unpin_checks_owner_and_count():
    idx = HostIndex(1 << 20)
    (a,) = _committed(idx, 1)
    idx.pin(a, owner="x")
    with pytest.raises(ValueError):
        idx.unpin(a, owner="y")
    idx.unpin(a, owner="x")
    with pytest.raises(ValueError):
        idx.unpin(a, owner=None)


def test_delete_of_a_pinned_entry_frees_it_at_the_last_unpin():
    idx = HostIndex(1 << 20)
    (a,) = _committed(idx, 1)
    idx.pin(a, None)
    idx.pin(a, None)
    assert idx.delete(K(1))
    assert not a.visible and not idx.delete(K(1))
    used = idx.used_bytes
    idx.unpin(a, None)
    assert idx.used_bytes == used
    idx.unpin(a, None)
    assert idx.used_bytes == 0 and K(1) not in idx and idx.lru_keys() == []


def test_owner_state_lists_reservations_and_pins():
    idx = HostIndex(1 << 20)
    (a,) = _committed(idx, 1)
    r = idx.reserve(K(2), 500, owner="conn")
    idx.pin(a, "conn")
    idx.pin(a, "conn")
    reserved, pins = idx.owner_state("conn")
    assert reserved == [r] and pins == [(a, 2)]
    idx.commit(r, 0)
    assert idx.owner_state("conn")[0] == []


def test_release_and_free_frees_only_at_the_last_pin():
    idx = HostIndex(1 << 20)
    (a,) = _committed(idx, 1)
    assert idx.pop_lru() is a
    idx.pin(a, None)  # the store's demotion pin
    idx.pin(a, "reader")
    assert not idx.release_and_free(a)
    idx.unpin(a, "reader")  # back to the LRU: it was read meanwhile
    assert idx.lru_keys() == [K(1)]
    (b,) = _committed(idx, 2)
    idx.pop_lru(), idx.pop_lru()
    idx.pin(b, None)
    assert idx.release_and_free(b) and K(2) not in idx
