"""vLLM's KV events into the router's KvIndex: the wire format decoded without vLLM, the block
map's exact keys (chains across events, removals, clears, what is not keyed), and the
follower against vLLM's real ``ZmqEventPublisher`` (``.venv-vllm``, one process for the
module): live events, a gap filled by vLLM's replay socket, a gap past its buffer."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvstore.keys import block_keys, salted
from router.workers.kv_index import KvIndex
from router.workers.vllm_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    VllmBlockMap,
    VllmKvEvents,
    decode_batch,
)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
NS = bytes(range(16))
BS = 4
PROMPT = list(range(1000, 1024))  # 6 blocks of 4
KEYS = block_keys(NS, PROMPT, BS)
OTHER = list(range(5000, 5012))  # 3 blocks


def _stored(hashes: list[Any], parent: Any, tokens: list[int], **fields: Any) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=fields.pop("block_size", BS), medium=fields.pop("medium", "GPU"),
                       **fields)


def _payload(*events: Any) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), 0])


# --- the wire, decoded without vLLM -----------------------------------------------------------

def test_decode_batch_reads_vllms_wire_format() -> None:
    # As vLLM 0.32 writes it: the batch an array, events maps tagged by "type", defaults left
    # out, fields this module does not read, and an event type it does not know.
    payload = msgspec.msgpack.encode([1.5, [
        {"type": "BlockStored", "block_hashes": [7, b"\x01" * 32], "parent_block_hash": None,
         "token_ids": PROMPT[:8], "block_size": BS, "lora_id": None, "medium": "GPU",
         "lora_name": None, "extra_keys": [["salt"], None], "group_idx": 0,
         "session_id": "s", "locality": "LOCAL"},
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
        {"type": "SomethingNew", "x": 1},
    ], 0])
    assert decode_batch(payload) == [
        BlockStored(block_hashes=[7, b"\x01" * 32], parent_block_hash=None, token_ids=PROMPT[:8],
                    block_size=BS, medium="GPU", extra_keys=[["salt"], None], group_idx=0),
        BlockRemoved(block_hashes=[7], medium="GPU"),
        AllBlocksCleared(),
        None,
    ]
    assert decode_batch(msgspec.msgpack.encode([2.0, []])) == []  # no rank: omitted default
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"\x01\x02")


# --- the block map (pure) --------------------------------------------------------------------

def test_a_chain_across_two_events_gets_our_exact_keys() -> None:
    m = VllmBlockMap(NS, BS)
    assert m.apply(_stored([11, 12], None, PROMPT[:8])) == ("stored", KEYS[:2])
    assert m.apply(_stored([13, 14, 15], 12, PROMPT[8:20])) == ("stored", KEYS[2:5])
    assert m.key_of(15) == KEYS[4] and len(m) == 5
    # bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) chain the same way
    m.apply(_stored([b"\xaa" * 32], None, OTHER[:4]))
    assert m.apply(_stored([b"\xbb" * 32], b"\xaa" * 32, OTHER[4:8])) == \
        ("stored", block_keys(NS, OTHER[:8], BS)[1:2])
    # a block stored again (a reuse report) is one entry: nothing new
    assert m.apply(_stored([11, 12], None, PROMPT[:8])) == ("stored", [])


def test_removed_and_all_blocks_cleared_map_back_and_forget() -> None:
    m = VllmBlockMap(NS, BS)
    m.apply(_stored([11, 12, 13], None, PROMPT[:12]))
    assert m.apply(BlockRemoved(block_hashes=[13, 99], medium="GPU")) == ("removed", [KEYS[2]])
    assert m.key_of(13) is None
    assert m.apply(BlockRemoved(block_hashes=[13])) == ("removed", [])  # already gone
    assert m.apply(AllBlocksCleared()) == ("removed", KEYS[:2])
    assert len(m) == 0 and m.keys() == []
    # forgotten: a child of a cleared block cannot be keyed any more
    assert m.apply(_stored([14], 13, PROMPT[12:16])) == ("stored", [])
    assert m.skipped == {"unknown_parent": 1}


def test_an_unknown_parent_is_skipped_and_counted() -> None:
    m = VllmBlockMap(NS, BS)
    assert m.apply(_stored([13, 14], 12, PROMPT[8:16])) == ("stored", [])
    assert m.apply(_stored([15], 14, PROMPT[16:20])) == ("stored", [])
    assert m.skipped == {"unknown_parent": 3}
    assert m.apply(_stored([11], None, PROMPT[:4])) == ("stored", KEYS[:1])


def test_cache_salt_lora_medium_and_extra_keys() -> None:
    m = VllmBlockMap(NS, BS)
    # the cache salt (block 0's only extra key) salts the namespace, as the router keys it
    salty = block_keys(salted(NS, "tenant"), PROMPT[:12], BS)
    assert m.apply(_stored([21, 22], None, PROMPT[:8], extra_keys=[["tenant"], None])) == \
        ("stored", salty[:2])
    assert m.apply(_stored([23], 22, PROMPT[8:12])) == ("stored", salty[2:])
    # a LoRA adapter's blocks are not the base model's
    assert m.apply(_stored([31], None, PROMPT[:4], lora_id=1, lora_name="ad",
                           extra_keys=[["ad"]])) == ("stored", [])
    # other media: neither stores nor removals touch the device's blocks
    assert m.apply(_stored([11], None, PROMPT[:4], medium="CPU")) == ("stored", [])
    assert m.apply(BlockRemoved(block_hashes=[21], medium="cpu")) == ("removed", [])
    assert m.key_of(21) == salty[0]
    # a multimodal block and the rest of its event are not keyed; the blocks before it are
    assert m.apply(_stored([41, 42, 43], None, OTHER[:12],
                           extra_keys=[None, [["img", 0]], None])) == \
        ("stored", block_keys(NS, OTHER[:4], BS))
    # another block size (a partial-prefix entry), or tokens that are not one block per hash
    assert m.apply(_stored([51], None, PROMPT[:2], block_size=2)) == ("stored", [])
    assert m.apply(_stored([52, 53], None, PROMPT[:4])) == ("stored", [])
    assert m.skipped == {"lora": 1, "medium": 2, "extra_keys": 2, "shape": 3}


def test_kv_cache_groups_are_kept_apart() -> None:
    m = VllmBlockMap(NS, BS)
    m.apply(_stored([11, 12], None, PROMPT[:8], group_idx=0))
    assert m.apply(_stored([11, 12], None, PROMPT[:8], group_idx=1)) == ("stored", [])
    assert m.apply(BlockRemoved(block_hashes=[12], group_idx=1)) == ("removed", [])
    assert m.apply(BlockRemoved(block_hashes=[12], group_idx=0)) == ("removed", [KEYS[1]])


def test_messages_in_order_duplicates_and_a_gap_without_replay() -> None:
    index, f = KvIndex(), VllmKvEvents("tcp://127.0.0.1:9", None, NS, BS)
    f.take(index, "w", 5, _payload(_stored([11, 12], None, PROMPT[:8])))  # any first seq
    assert index.match(KEYS, ["w"]) == {"w": 2} and f.next_seq == 6
    f.take(index, "w", 5, _payload(AllBlocksCleared()))  # a duplicate: ignored
    f.take(index, "w", 6, _payload(_stored([13], 12, PROMPT[8:12])))
    assert index.match(KEYS, ["w"]) == {"w": 3}
    # seq 7 lost: the worker starts over, and 8's block has no parent to chain from
    f.take(index, "w", 8, _payload(_stored([14], 13, PROMPT[12:16]),
                                   _stored([61], None, OTHER[:4])))
    assert index.match(KEYS, ["w"]) == {"w": 0} and f.stats["resets"] == 1
    assert index.match(block_keys(NS, OTHER, BS), ["w"]) == {"w": 1}
    f.take(index, "w", 9, b"not msgpack")
    assert f.stats["undecodable"] == 1 and f.next_seq == 10


# --- against vLLM's own publisher ------------------------------------------------------------

class Publisher:
    """``tests/router/vllm_events_publisher.py`` running in the vLLM environment."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.published = 0  # batches since the last open: the next one's seq

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the vLLM publisher exited ({self.proc.poll()})"
        return json.loads(line)

    def open(self, **cfg: Any) -> tuple[str, str]:
        answer = self.call(op="open", **cfg)
        self.published = 0
        return answer["endpoint"], answer["replay_endpoint"]

    def publish(self, *events: dict[str, Any]) -> int:
        seq = self.call(op="publish", events=list(events))["seq"]
        assert seq == self.published
        self.published += 1
        return seq


def stored(hashes: list[Any], parent: Any, tokens: list[int], **fields: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, **fields}


def removed(hashes: list[Any], **fields: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, **fields}


@pytest.fixture(scope="module")
def vllm_pub(tmp_path_factory: pytest.TempPathFactory, module_procs) -> Iterator[Publisher]:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"the vLLM environment is missing ({VLLM_PYTHON}): bash scripts/setup_vllm.sh")
    log = (tmp_path_factory.mktemp("vllm") / "publisher.log").open("w")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "VLLM_HOST_IP": "127.0.0.1"}
    proc = module_procs.popen([str(VLLM_PYTHON), "-u", "-m", "vllm_events_publisher"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline() or "{}").get("ready"), \
            f"the vLLM publisher did not start: see {log.name}"
        yield Publisher(proc)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def run(coro_fn: Callable[[], Any]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 60))


async def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class Lossy(VllmKvEvents):
    """Loses the live messages whose seq is in ``drop`` (the replay socket still has them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drop: set[int] = set()

    async def _receive(self, sock: Any, timeout: float | None) -> list[bytes] | None:
        while True:
            frames = await super()._receive(sock, timeout)
            if frames is None or int.from_bytes(frames[1], "big") not in self.drop:
                return frames


async def go_live(pub: Publisher, f: VllmKvEvents) -> None:
    """Publish empty batches until one arrives on the live socket (the subscription is up),
    and wait until every one is taken."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not f.stats["live"]:
        assert loop.time() < deadline, "no live message from the vLLM publisher"
        pub.publish()
        end = loop.time() + 0.2
        while not f.stats["live"] and loop.time() < end:
            await asyncio.sleep(0.01)
    await until(lambda: f.next_seq == pub.published, "the warm-up batches")


def test_real_publisher_stores_and_removes(vllm_pub: Publisher) -> None:
    async def main() -> None:
        endpoint, replay = vllm_pub.open(topic="kv")
        index, f = KvIndex(), VllmKvEvents(endpoint, replay, NS, BS, topic="kv", idle_replay=0.2)
        task = asyncio.create_task(f.follow(index, "w"))
        try:
            vllm_pub.publish(stored([11, 12], None, PROMPT[:8]))
            vllm_pub.publish(stored([13, 14], 12, PROMPT[8:16]),
                             stored([31], None, OTHER[:4], lora_id=1, lora_name="ad"),
                             stored([15], 14, PROMPT[16:20], medium="CPU"))
            await until(lambda: index.match(KEYS, ["w"]) == {"w": 4}, "4 blocks")
            vllm_pub.publish(removed([14]), removed([13], medium="CPU"))
            await until(lambda: index.match(KEYS, ["w"]) == {"w": 3}, "block 3 removed")
            salty = block_keys(salted(NS, "t"), OTHER[:8], BS)
            vllm_pub.publish(stored([{"bytes": "ab" * 32}], None, OTHER[:4], extra_keys=[["t"]]),
                             stored([{"bytes": "cd" * 32}], {"bytes": "ab" * 32}, OTHER[4:8]))
            await until(lambda: index.match(salty, ["w"]) == {"w": 2}, "the salted blocks")
            assert f.blocks.skipped == {"lora": 1, "medium": 2}
            assert index.num_blocks("w") == 5
            vllm_pub.publish({"type": "AllBlocksCleared"})
            await until(lambda: index.num_blocks("w") == 0, "all blocks cleared")
            assert f.stats["undecodable"] == 0 and f.stats["resets"] == 0
        finally:
            task.cancel()
    run(main)


def test_real_gap_is_filled_by_vllms_replay(vllm_pub: Publisher) -> None:
    async def main() -> None:
        endpoint, replay = vllm_pub.open()
        index, f = KvIndex(), Lossy(endpoint, replay, NS, BS, idle_replay=None)
        task = asyncio.create_task(f.follow(index, "w"))
        try:
            await go_live(vllm_pub, f)
            before = f.stats.copy()
            f.drop = {vllm_pub.published + 1}
            vllm_pub.publish(stored([11, 12], None, PROMPT[:8]))
            vllm_pub.publish(stored([13, 14], 12, PROMPT[8:16]))  # lost on the live socket
            vllm_pub.publish(stored([15, 16], 14, PROMPT[16:24]))  # shows the gap
            await until(lambda: index.match(KEYS, ["w"]) == {"w": 6}, "all 6 blocks")
            assert f.stats["gaps"] - before["gaps"] == 1
            assert f.stats["replayed"] - before["replayed"] == 2  # the lost one and the next
            assert f.stats["resets"] == before["resets"]
            assert f.blocks.skipped == {}
        finally:
            task.cancel()
    run(main)


def test_real_gap_past_the_replay_buffer_resets_the_worker(vllm_pub: Publisher) -> None:
    async def main() -> None:
        endpoint, replay = vllm_pub.open(buffer_steps=2)
        index, f = KvIndex(), Lossy(endpoint, replay, NS, BS, idle_replay=None)
        task = asyncio.create_task(f.follow(index, "w"))
        try:
            await go_live(vllm_pub, f)
            a = vllm_pub.publish(stored([11, 12], None, PROMPT[:8]))
            await until(lambda: index.match(KEYS, ["w"]) == {"w": 2}, "2 blocks")
            before = f.stats.copy()
            f.drop = {a + 1, a + 2, a + 3}
            q, r = list(range(7000, 7012)), list(range(8000, 8008))
            vllm_pub.publish(stored([21, 22], None, q[:8]))   # lost: the buffer keeps 2
            vllm_pub.publish(stored([23], 22, q[8:12]))        # lost
            vllm_pub.publish(stored([31], None, r[:4]))        # lost live, still buffered
            vllm_pub.publish(stored([32], 31, r[4:8]))         # shows the gap
            await until(lambda: f.stats["resets"] > before["resets"], "a reset")
            await until(lambda: index.match(block_keys(NS, r, BS), ["w"]) == {"w": 2}, "r's blocks")
            assert index.match(KEYS, ["w"]) == {"w": 0}  # dropped with the reset
            assert index.match(block_keys(NS, q, BS), ["w"]) == {"w": 0}
            assert index.num_blocks("w") == 2 and f.next_seq == a + 5
        finally:
            task.cancel()
    run(main)
