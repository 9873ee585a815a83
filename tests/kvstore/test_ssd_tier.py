"""The LMDB tier: capacity LRU, verification, restart, kill -9 atomicity."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvstore.keys import BlockKey
from kvstore.node.ssd_tier import SsdTier, checksum


def K(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def V(i: int, size: int = 4096) -> bytes:
    return (i.to_bytes(16, "little") * (size // 16 + 1))[:size]


def _put(tier: SsdTier, ids, size=4096):
    return tier.put_many([(K(i), checksum(V(i, size)), V(i, size)) for i in ids])


def test_capacity_evicts_least_recently_used_tail_first(tmp_path):
    tier = SsdTier(str(tmp_path), capacity_bytes=4 * 4096)
    assert _put(tier, [3, 2, 1, 0]) == []  # a prefix 0..3 demoted tail first
    assert tier.get(K(3)) == V(3)  # a read makes 3 the most recent
    assert _put(tier, [10, 11]) == [K(2), K(1)]
    assert tier.lru_keys() == [K(0), K(3), K(10), K(11)]
    assert tier.used_bytes == 4 * 4096
    tier.close()


def test_index_and_order_survive_reopen(tmp_path):
    tier = SsdTier(str(tmp_path), capacity_bytes=1 << 20)
    _put(tier, [5, 4, 3])
    _put(tier, [9])
    tier.close()
    tier = SsdTier(str(tmp_path), capacity_bytes=1 << 20)
    assert tier.lru_keys() == [K(5), K(4), K(3), K(9)]
    assert all(tier.get(K(i)) == V(i) for i in (3, 4, 5, 9))
    _put(tier, [1])
    assert tier.lru_keys()[-1] == K(1)  # stamps continue after the largest found
    tier.close()


def test_a_corrupt_record_is_a_miss_and_is_deleted(tmp_path):
    tier = SsdTier(str(tmp_path), capacity_bytes=1 << 20)
    _put(tier, [1, 2])
    _damage(tier, K(1))
    assert tier.get(K(1)) is None
    assert K(1) not in tier and tier.corrupt == 1
    assert tier.get(K(2)) == V(2)
    tier.close()


def _damage(tier: SsdTier, key: BlockKey) -> None:
    """Flip one byte of a stored block, as a bad disk page would (LMDB is open once per process)."""
    env = tier._env
    data_db = env.open_db(b"data")
    with env.begin(write=True) as txn:
        bad = bytearray(txn.get(key, db=data_db))
        bad[100] ^= 0xFF
        txn.put(key, bytes(bad), db=data_db)


_WRITER = r"""
import sys
from kvstore.keys import BlockKey
from kvstore.node.ssd_tier import SsdTier, checksum
tier = SsdTier(sys.argv[1], capacity_bytes=1 << 30)
size = 256 * 1024
i = 0
while True:
    batch = []
    for _ in range(16):
        i += 1
        key = BlockKey(i.to_bytes(16, "little"))
        batch.append((key, checksum(bytes([i % 251]) * size), bytes([i % 251]) * size))
    tier.put_many(batch)
    print(i, flush=True)  # every block up to i is committed
"""


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_kill_9_mid_write_leaves_every_committed_block_and_nothing_half_written(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    committed = 0
    deadline = time.monotonic() + 30
    while committed < 400 and time.monotonic() < deadline:
        committed = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)  # almost surely inside the next transaction
    proc.wait(timeout=10)
    assert committed >= 400
    tier = SsdTier(str(tmp_path), capacity_bytes=1 << 30)
    size = 256 * 1024
    assert len(tier) >= committed and len(tier) % 16 == 0  # whole transactions only
    for i in range(1, len(tier) + 1):
        assert tier.get(K(i)) == bytes([i % 251]) * size, i
    assert K(len(tier) + 1) not in tier and tier.corrupt == 0
    tier.close()


def test_files_are_the_owners_only(tmp_path):
    from kvstore.daemon.identity import resolve_node_id

    path = tmp_path / "ssd"
    resolve_node_id(str(path))
    tier = SsdTier(str(path), capacity_bytes=1 << 20)
    _put(tier, [1])
    tier.close()
    assert path.stat().st_mode & 0o777 == 0o700
    for name in ("data.mdb", "lock.mdb", "node_id"):
        assert (path / name).stat().st_mode & 0o777 == 0o600, name
    loose = tmp_path / "loose"  # made world-readable by an older version: tightened
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    SsdTier(str(loose), capacity_bytes=1 << 20).close()
    assert loose.stat().st_mode & 0o777 == 0o700


def damage(path) -> None:
    """Overwrite LMDB's two meta pages (the header) with garbage."""
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        f.write(os.urandom(8192))


def test_a_damaged_tier_is_moved_aside_or_refused(tmp_path):
    import lmdb
    import pytest

    path = tmp_path / "ssd"
    (tmp_path / "ssd").mkdir()
    (path / "node_id").write_text("abc\n")
    tier = SsdTier(str(path), capacity_bytes=1 << 20)
    _put(tier, [1, 2])
    tier.close()
    damage(path)
    with pytest.raises(lmdb.Error):
        SsdTier(str(path), capacity_bytes=1 << 20, on_corrupt="fail")
    tier = SsdTier(str(path), capacity_bytes=1 << 20)
    assert tier.moved_aside is not None and ".corrupt-" in tier.moved_aside
    assert len(tier) == 0 and tier.get(K(1)) is None
    assert (path / "node_id").read_text() == "abc\n"  # the node keeps its identity
    assert os.path.exists(os.path.join(tier.moved_aside, "data.mdb"))
    _put(tier, [3])
    assert tier.get(K(3)) == V(3)
    tier.close()
