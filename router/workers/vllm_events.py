"""Cache locality from vLLM's own KV cache events: one vLLM instance's event stream keeps the
router's :class:`~router.workers.kv_index.KvIndex` in step for that worker, in our block keys.

Wire format (vLLM 0.32, ``vllm/distributed/kv_events.py``), decoded with msgspec (never vLLM):

- Live: a ZMQ PUB socket at ``KVEventsConfig.endpoint`` (one per data-parallel rank, its port
  offset by the rank: follow each as a worker). A message is three frames: ``topic``
  (``KVEventsConfig.topic``, UTF-8, ``""`` by default), ``seq`` (8 bytes big-endian: 0 for the
  publisher's first batch, +1 per batch), and one ``KVEventBatch`` in msgspec msgpack.
- ``KVEventBatch`` is ``array_like``: ``[ts: float, events: [...], data_parallel_rank: int]``
  (the rank left out when None). An event is a *map* tagged by ``"type"`` (its class name),
  fields at their default left out: ``{"type": "BlockStored", "block_hashes": [h, ...],
  "parent_block_hash": h | None, "token_ids": [int, ...], "block_size": int, "lora_id": int |
  None, "medium": str | None, "lora_name": str | None, "extra_keys"?: [[...] | None, ...],
  "group_idx"?: int, ...}``, ``{"type": "BlockRemoved", "block_hashes": [h, ...], "medium":
  str | None, "group_idx"?: int, ...}``, ``{"type": "AllBlocksCleared"}``. Other fields
  (``kv_cache_spec_*``, ``locality``, ``ownership``, ``session_id``) are ignored, events of
  other types skipped (``stats["undecodable"]``).
- A block hash ``h`` is an int, the low 64 bits of vLLM's hash bytes read big-endian (the
  default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), or those bytes (32 for sha256).
  ``token_ids`` holds ``block_size`` tokens per stored block; ``parent_block_hash`` is the
  hash of the block before the first (None: a prompt's block 0). ``extra_keys``, one entry per
  block, untagged, in order: the LoRA name, ``[mm_identifier, offset]`` pairs, the cache salt
  (block 0 only), prompt-embedding digests.
- Replay: a ROUTER socket at ``replay_endpoint`` keeps the last ``buffer_steps`` messages. A
  DEALER (not a REQ: one request, many replies) sends ``["", start_seq (8 bytes big-endian)]``
  and gets ``["", topic, seq, payload]`` for each buffered message with ``seq >= start_seq``,
  oldest first, then ``["", "", -1 (8 bytes, signed big-endian), ""]``. A first ``seq`` above
  ``start_seq`` means the buffer no longer has the ones between.

Keys (:class:`VllmBlockMap`, pure): per ``(group_idx, vLLM hash)`` the BlockKey it stands for.
A BlockStored extends ``kvstore.keys.block_keys`` from its parent's key (a block 0 from the
namespace); BlockRemoved and AllBlocksCleared are mapped back and forgotten. A key leaves the
index when no ``(group_idx, hash)`` maps to it (a hash stored twice is one entry, its first
removal ends it: at worst a hint missing, never a wrong key). Not keyed, counted by reason in
``skipped`` (blocks), so that a key always names exactly the KV our keys mean:

- ``unknown_parent``: a parent never seen (or forgotten): the blocks cannot be chained.
- ``medium``: another medium than ``"GPU"`` (vLLM's primary block pool, on its CPU backend
  too; None from older versions). CPU, storage and connector tiers are other caches than the
  one the index describes: their stores and removals are both ignored.
- ``lora``: a LoRA adapter's blocks. The router keys prompts for the base model, and the
  connector salts by the adapter's name *and path*, which the events lack.
- ``extra_keys``: a block its tokens do not name (multimodal items, prompt embeddings), and
  the event's blocks after it. The cache salt is mapped: a block 0 whose only extra key is a
  string starts from ``salted(namespace, salt)``, as the router keys a ``cache_salt``.
- ``shape``: a ``block_size`` not ours (partial-prefix entries, other groups), or not
  ``block_size`` tokens per hash (null blocks of sliding-window or Mamba groups left out).

Gaps (:class:`VllmKvEvents`): the index sees the worker through our own contiguous sequence of
``BlockEvent`` s. A ``seq`` past the one expected asks the replay socket for the missing
messages; what it cannot cover (no replay socket, buffer too short, a timeout) resets: the
worker's blocks leave the index and the map starts over. Following starts with a replay from 0
(what the buffer still holds); ``idle_replay`` seconds of silence replay a lost tail.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio

from engine.api.events import BlockEvent, LoadFigures, Snapshot
from kvstore.keys import BlockKey, block_keys, salted
from router.workers.kv_index import KvIndex

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "VllmEvent", "decode_batch",
           "VllmBlockMap", "VllmKvEvents"]

log = logging.getLogger(__name__)

VllmHash = int | bytes
DEVICE_MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class BlockStored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[VllmHash]
    parent_block_hash: VllmHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[VllmHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


VllmEvent = BlockStored | BlockRemoved | AllBlocksCleared


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(_Batch)
_event_decoder = msgspec.msgpack.Decoder(VllmEvent)


def decode_batch(payload: bytes) -> list[VllmEvent | None]:
    """A ``KVEventBatch`` payload's events; None for one of an unknown type or malformed.
    Raises ``msgspec.DecodeError`` (a ``ValueError``) if the batch itself is not one."""
    events: list[VllmEvent | None] = []
    for raw in _batch_decoder.decode(payload).events:
        try:
            events.append(_event_decoder.decode(raw))
        except msgspec.DecodeError:
            events.append(None)
    return events


class VllmBlockMap:
    """One worker's vLLM block hashes → our block keys (see the module docstring)."""

    def __init__(self, namespace: bytes, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.namespace = BlockKey(namespace)
        self.block_size = block_size
        self.skipped: Counter[str] = Counter()  # blocks not keyed, by reason
        self._keys: dict[tuple[int | None, VllmHash], BlockKey] = {}
        self._refs: dict[BlockKey, int] = {}  # key -> number of (group, hash) mapping to it

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> list[BlockKey]:
        """Every key the worker holds, as far as its events said."""
        return list(self._refs)

    def key_of(self, block_hash: VllmHash, group_idx: int | None = None) -> BlockKey | None:
        return self._keys.get((group_idx, block_hash))

    def apply(self, event: VllmEvent) -> tuple[Literal["stored", "removed"], list[BlockKey]]:
        """One event in order: the keys that entered (``stored``) or left the worker."""
        if isinstance(event, AllBlocksCleared):
            return "removed", self.clear()
        if (event.medium or DEVICE_MEDIUM).upper() != DEVICE_MEDIUM:
            skipped = self._skip("medium", len(event.block_hashes))
            return ("removed" if isinstance(event, BlockRemoved) else "stored"), skipped
        if isinstance(event, BlockRemoved):
            return "removed", self._remove(event)
        return "stored", self._store(event)

    def clear(self) -> list[BlockKey]:
        """Forget everything; returns the keys that were held."""
        held = list(self._refs)
        self._keys.clear()
        self._refs.clear()
        return held

    def _store(self, ev: BlockStored) -> list[BlockKey]:
        n, bs, group = len(ev.block_hashes), self.block_size, ev.group_idx
        if ev.lora_id is not None or ev.lora_name:
            return self._skip("lora", n)
        extras = ev.extra_keys if ev.extra_keys is not None else [None] * n
        if ev.block_size != bs or len(ev.token_ids) != n * bs or len(extras) != n:
            return self._skip("shape", n)
        if ev.parent_block_hash is None:
            start = self.namespace
        else:
            parent = self._keys.get((group, ev.parent_block_hash))
            if parent is None:
                return self._skip("unknown_parent", n)
            start = parent
        keyed = n
        for i, extra in enumerate(extras):
            if extra is None:
                continue
            salt = extra[0] if len(extra) == 1 and isinstance(extra[0], str) else None
            if i == 0 and ev.parent_block_hash is None and salt:
                start = salted(self.namespace, salt)
                continue
            keyed = i
            self._skip("extra_keys", n - i)
            break
        stored: list[BlockKey] = []
        for h, key in zip(ev.block_hashes, block_keys(start, ev.token_ids[: keyed * bs], bs)):
            if (group, h) in self._keys:
                continue
            self._keys[group, h] = key
            refs = self._refs.get(key, 0)
            self._refs[key] = refs + 1
            if not refs:
                stored.append(key)
        return stored

    def _remove(self, ev: BlockRemoved) -> list[BlockKey]:
        removed: list[BlockKey] = []
        for h in ev.block_hashes:
            key = self._keys.pop((ev.group_idx, h), None)
            if key is None:
                continue
            refs = self._refs[key] - 1
            if refs:
                self._refs[key] = refs
            else:
                del self._refs[key]
                removed.append(key)
        return removed

    def _skip(self, reason: str, blocks: int) -> list[BlockKey]:
        self.skipped[reason] += blocks
        return []


class VllmKvEvents:
    """Follows one vLLM instance's KV events into a :class:`KvIndex` (see the module docstring).

    ``replay_timeout``: seconds to wait for each replayed message; ``idle_replay``: seconds of
    silence after which the replay socket is asked for anything missed (None: never).
    ``stats`` counts messages ``live`` and ``replayed``, ``gaps``, ``resets`` and
    ``undecodable`` events; ``blocks.skipped`` the blocks not keyed."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, namespace: bytes,
                 block_size: int, topic: str = "", *, replay_timeout: float = 5.0,
                 idle_replay: float | None = 10.0) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.replay_timeout = replay_timeout
        self.idle_replay = idle_replay
        self.blocks = VllmBlockMap(namespace, block_size)
        self.stats: Counter[str] = Counter()
        self._next: int | None = None  # the vLLM seq expected next; None: take any
        self._seq = 0  # our own numbering of the index's BlockEvents

    @property
    def next_seq(self) -> int | None:
        """The vLLM ``seq`` expected next (None: none taken yet, and no replay to ask)."""
        return self._next

    async def follow(self, index: KvIndex, worker_id: str) -> None:
        """Keep ``index``'s view of ``worker_id`` in step with the instance until cancelled.
        Starts over: the worker's blocks in the index are replaced by what the events say."""
        self._next = 0 if self.replay_endpoint else None
        self._reset(index, worker_id, None)
        sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            sub.connect(self.endpoint)
            if self.replay_endpoint:
                await self._replay(index, worker_id)
            idle = self.idle_replay if self.replay_endpoint else None
            while True:
                frames = await self._receive(sub, idle)
                if frames is None:
                    await self._replay(index, worker_id)
                    continue
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.stats["undecodable"] += 1
                    continue
                self.stats["live"] += 1
                seq = int.from_bytes(frames[1], "big")
                if self._next is not None and seq > self._next and self.replay_endpoint:
                    self.stats["gaps"] += 1
                    log.info("vLLM events of %s: seq %d after %d; replaying", worker_id, seq,
                             self._next - 1)
                    await self._replay(index, worker_id)
                self.take(index, worker_id, seq, frames[2])
        finally:
            sub.close(linger=0)

    def take(self, index: KvIndex, worker_id: str, seq: int, payload: bytes) -> None:
        """Apply one message, live or replayed, in order: a ``seq`` already taken is ignored, one
        past the next expected first resets the worker if it holds blocks (messages were lost)."""
        if self._next is not None and seq < self._next:
            return
        if self._next is not None and seq > self._next and len(self.blocks):
            self._reset(index, worker_id, f"messages {self._next}..{seq - 1} lost")
        self._next = seq + 1
        try:
            events = decode_batch(payload)
        except msgspec.DecodeError:
            self.stats["undecodable"] += 1
            return
        for event in events:
            if event is None:
                self.stats["undecodable"] += 1
                continue
            kind, keys = self.blocks.apply(event)
            if keys:
                self._seq += 1
                if not index.apply(worker_id, BlockEvent(self._seq, kind, tuple(keys))):
                    # The index forgot the worker (or someone else reset it): restate it.
                    held = tuple(self.blocks.keys())
                    index.reset(worker_id, Snapshot(self._seq, held, LoadFigures()))

    async def _receive(self, sock: zmq.asyncio.Socket,
                       timeout: float | None) -> list[bytes] | None:
        """The next live message; None after ``timeout`` seconds without one."""
        if timeout is not None and not await sock.poll(int(timeout * 1000)):
            return None
        return await sock.recv_multipart()

    async def _replay(self, index: KvIndex, worker_id: str) -> None:
        """Take the buffered messages from the next expected ``seq`` on (see :meth:`take`)."""
        assert self.replay_endpoint is not None
        start = self._next or 0
        dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(int(self.replay_timeout * 1000)):
                    log.warning("vLLM events of %s: replay from %d timed out", worker_id, start)
                    return
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self.stats["undecodable"] += 1
                    continue
                if frames[2] == END_SEQ:
                    return
                self.stats["replayed"] += 1
                self.take(index, worker_id, int.from_bytes(frames[2], "big"), frames[3])
        finally:
            dealer.close(linger=0)

    def _reset(self, index: KvIndex, worker_id: str, why: str | None) -> None:
        """Drop the worker's blocks from the index and start the map over."""
        if why is not None:
            self.stats["resets"] += 1
            log.warning("vLLM events of %s: %s; its blocks leave the index", worker_id, why)
        self.blocks.clear()
        self._seq += 1
        index.reset(worker_id, Snapshot(self._seq, (), LoadFigures()))
