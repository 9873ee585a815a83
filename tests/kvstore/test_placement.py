"""Rendezvous placement: determinism, balance, minimal movement, replicas."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest
import xxhash

from kvstore.client.placement import Placement, owners, ranking

KEYS = [xxhash.xxh3_128(i.to_bytes(4, "little")).digest() for i in range(20000)]
NODES = [f"node-{i}" for i in range(5)]


def _owner_map(nodes, keys=KEYS):
    p = Placement(nodes)
    return [p.owners(k)[0] for k in keys]


def test_weight_is_xxh3_64_of_node_id_and_key():
    key = KEYS[0]
    expected = max(NODES, key=lambda n: xxhash.xxh3_64_intdigest(n.encode() + key))
    assert owners(key, NODES) == [expected]
    assert ranking(key, NODES) == sorted(
        NODES, key=lambda n: xxhash.xxh3_64_intdigest(n.encode() + key), reverse=True
    )


def test_independent_of_node_order_and_duplicates():
    p1, p2 = Placement(NODES), Placement(list(reversed(NODES)) + NODES[:2])
    assert all(p1.ranking(k) == p2.ranking(k) for k in KEYS[:500])


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_deterministic_across_processes():
    code = (
        "import xxhash; from kvstore.client.placement import Placement;"
        "p = Placement([f'node-{i}' for i in range(5)]);"
        "keys = [xxhash.xxh3_128(i.to_bytes(4, 'little')).digest() for i in range(200)];"
        "print(','.join(p.owners(k)[0] for k in keys))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out.split(",") == _owner_map(NODES, KEYS[:200])


def test_balance_within_tolerance():
    counts = Counter(_owner_map(NODES))
    expected = len(KEYS) / len(NODES)
    assert set(counts) == set(NODES)
    for node, n in counts.items():
        assert abs(n - expected) / expected < 0.05, (node, n, expected)


def test_adding_a_node_moves_only_its_share():
    before = _owner_map(NODES)
    after = _owner_map(NODES + ["node-new"])
    moved = [(b, a) for b, a in zip(before, after) if b != a]
    assert all(a == "node-new" for _, a in moved)  # keys only ever move to the newcomer
    share = len(moved) / len(KEYS)
    assert abs(share - 1 / (len(NODES) + 1)) < 0.02, share


def test_removing_a_node_moves_only_its_keys_to_their_next_ranked_node():
    p = Placement(NODES)
    gone = "node-2"
    after = Placement([n for n in NODES if n != gone])
    for k in KEYS[:5000]:
        rank = p.ranking(k)
        new_owner = after.owners(k)[0]
        if rank[0] != gone:
            assert new_owner == rank[0]
        else:
            assert new_owner == rank[1]


def test_replicas_are_distinct_top_r():
    p = Placement(NODES)
    for k in KEYS[:1000]:
        reps = p.owners(k, r=3)
        assert len(set(reps)) == 3 and reps == p.ranking(k)[:3]
    assert p.owners(KEYS[0], r=10) == p.ranking(KEYS[0])  # capped at the node count
    assert Placement([]).owners(KEYS[0]) == []
    with pytest.raises(ValueError):
        p.owners(KEYS[0], r=0)
