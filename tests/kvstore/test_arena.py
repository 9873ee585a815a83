"""The shared-memory arena and the allocator that carves it."""

from __future__ import annotations

import fcntl
import os
import random
import subprocess
import sys
import time
from collections import OrderedDict

import pytest

from kvstore.node.allocator import Allocator
from kvstore.node.arena import SHM_DIR, Arena, _owner_alive, remove_stale_arenas

KIB = 1024
BLOCK_360 = 360 * KIB + 64  # one 16-token SmolLM2 block in bf16, with the codec header
BLOCK_720 = 720 * KIB + 64  # the same in float32


def test_attach_shares_bytes_and_only_the_owner_unlinks():
    with Arena.create(1 << 16) as owner:
        path = os.path.join(SHM_DIR, owner.name)
        client = Arena.attach(owner.name)
        assert client.size == owner.size == 1 << 16
        client.buf[100:105] = b"hello"
        assert bytes(owner.buf[100:105]) == b"hello"
        client.close()
        assert os.path.exists(path)
    assert not os.path.exists(path)


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_a_client_process_exiting_does_not_unlink_the_arena():
    with Arena.create(1 << 16) as owner:
        code = (
            "import sys; from kvstore.node.arena import Arena\n"
            "a = Arena.attach(sys.argv[1]); a.buf[0:3] = b'xyz'; a.close()\n"
        )
        subprocess.run([sys.executable, "-c", code, owner.name], check=True, timeout=30)
        assert os.path.exists(os.path.join(SHM_DIR, owner.name))
        assert bytes(owner.buf[0:3]) == b"xyz"


def test_names_are_validated_and_taken_names_refused():
    with pytest.raises(ValueError):
        Arena.create(4096, name="a/b")
    with Arena.create(4096) as a:
        with pytest.raises(FileExistsError):
            Arena.create(4096, name=a.name)
    with pytest.raises(FileNotFoundError):
        Arena.attach("kvstore-no-such-arena")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_stale_arenas_of_dead_owners_are_removed_and_nothing_else(tmp_path):
    dead = _dead_pid()
    names = {
        "stale": f"kvstore-{dead}-0123abcd",
        "mine_unlocked": f"kvstore-{os.getpid()}-0123abcd",  # as between create and flock
        "dead_but_locked": f"kvstore-{dead}-89abcdef",  # e.g. a forked child holds it
        "other_scheme": f"kvstore-{dead}-xyz",
        "other_name": f"mooncake-{dead}-0123abcd",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"\0" * 64)
    fd = os.open(tmp_path / names["dead_but_locked"], os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert remove_stale_arenas(str(tmp_path)) == [names["stale"]]
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == sorted(v for k, v in names.items() if k != "stale")
    assert remove_stale_arenas(str(tmp_path)) == [names["dead_but_locked"]]  # lock released


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_a_reused_pid_does_not_keep_an_arena_alive():
    assert _owner_alive(os.getpid(), created=time.time())
    assert not _owner_alive(os.getpid(), created=0.0)  # this process started after 1970
    assert not _owner_alive(_dead_pid(), created=0.0)


def test_a_live_owner_holds_its_arena_locked_until_close():
    with Arena.create(4096) as a:
        assert a.name not in remove_stale_arenas()
        fd = os.open(os.path.join(SHM_DIR, a.name), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert not os.path.exists(os.path.join(SHM_DIR, a.name))


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_a_killed_owner_leaves_an_arena_that_the_sweep_removes():
    code = ("import os, signal, sys; from kvstore.node.arena import Arena\n"
            "a = Arena.create(1 << 16); print(a.name, flush=True); os.kill(os.getpid(), signal.SIGKILL)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    name = r.stdout.strip()
    assert r.returncode == -9 and os.path.exists(os.path.join(SHM_DIR, name))
    assert name in remove_stale_arenas()
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_close_survives_a_held_slice():
    a = Arena.create(1 << 16)
    view = a.view(0, 128)
    a.close()  # must not raise; the name goes at once
    assert not os.path.exists(os.path.join(SHM_DIR, a.name))
    view.release()


def test_offsets_are_aligned_and_free_coalesces():
    alloc = Allocator(1 << 20, granule=64)
    offs = [alloc.alloc(s) for s in (1, 100, 4097, 65)]
    assert all(o is not None and o % 64 == 0 for o in offs)
    assert alloc.used_bytes == 64 + 128 + 4160 + 128
    for o in (offs[1], offs[3], offs[0], offs[2]):
        alloc.free(o)
    assert alloc.used_bytes == 0 and alloc.largest_free == 1 << 20
    with pytest.raises(ValueError):
        alloc.free(offs[0])


def _fill_and_churn(alloc: Allocator, rng: random.Random, sizes, cycles: int):
    """Allocate random sizes; on failure record block bytes held, evict LRU until it fits."""
    lru: OrderedDict[int, int] = OrderedDict()
    held = 0
    at_failure: list[float] = []
    for _ in range(cycles):
        size = rng.choice(sizes)
        off = alloc.alloc(size)
        if off is None:
            at_failure.append(held / alloc.capacity)
        while off is None:
            victim, vsize = lru.popitem(last=False)
            alloc.free(victim)
            held -= vsize
            off = alloc.alloc(size)
        lru[off] = size
        held += size
    return at_failure, lru


@pytest.mark.parametrize("granule", [64, 4096])
def test_mixed_360_720_kib_blocks_fill_over_90_percent_before_and_after_churn(granule):
    rng = random.Random(0)
    alloc = Allocator(256 << 20, granule=granule)
    at_failure, _ = _fill_and_churn(alloc, rng, [BLOCK_360, BLOCK_720], cycles=6000)
    assert len(at_failure) > 4000  # thousands of evict/allocate cycles
    assert at_failure[0] >= 0.90, f"first eviction at {at_failure[0]:.3f}"
    assert min(at_failure) >= 0.90, f"after churn down to {min(at_failure):.3f}"


def test_a_16_mib_value_fits_after_churn():
    rng = random.Random(1)
    alloc = Allocator(128 << 20, granule=64)
    _, lru = _fill_and_churn(alloc, rng, [BLOCK_360, BLOCK_720], cycles=2000)
    off = alloc.alloc(16 << 20)
    while off is None:
        alloc.free(lru.popitem(last=False)[0])
        off = alloc.alloc(16 << 20)
    assert off % 64 == 0 and off + (16 << 20) <= alloc.capacity
