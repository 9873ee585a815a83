"""``UcxChannel``: one daemon session's UCX endpoint, its sends and its posted receives.

The wire is ``kvstore.net.ucx``'s (its docstring is the spec). A ``Session``
(``kvstore.net.session``) makes a channel when an authenticated client asks for UCX, and
uses it for its ``FLAG_UCX`` requests:

- ``send_blocks``: a GET's blocks, straight from their pinned arena slots; returns once
  every send completed, so the caller unpins after it (a block being read is never evicted).
  Waits end early, with ``UcxError``, once the session's socket hung up.
- ``post`` / ``take``: a RESERVE posts a receive into each reserved slot; COMMIT takes the
  keys' receives and waits for them before the store commits.
- ``close``: closes the endpoint, which cancels whatever is still posted, and waits for it;
  False when something did not finish, and the session then leaves its slots reserved and
  pinned rather than free memory a late message could still write.
"""

from __future__ import annotations

import select
import time
from typing import Any, Sequence

from kvstore.errors import ProtocolError
from kvstore.keys import BlockKey
from kvstore.net import ucx

__all__ = ["UcxChannel"]


class UcxChannel:
    """One session's endpoint to its client's worker (module docstring)."""

    def __init__(self, worker: ucx.Worker, meta: Any, fd: int) -> None:
        if (not isinstance(meta, dict) or not isinstance(meta.get("address"), str)
                or not isinstance(meta.get("prefix"), int) or not 0 < meta["prefix"] < 1 << 32):
            raise ProtocolError('UCX meta must be {"address": hex, "prefix": u32 > 0}')
        try:
            address = bytes.fromhex(meta["address"])
        except ValueError:
            raise ProtocolError("UCX address is not hex") from None
        try:
            self.ep = worker.endpoint(address)
        except ValueError as e:
            raise ProtocolError(f"UCX: {e}") from None
        self._worker = worker
        self._poll = select.poll()  # the session's socket (fd): hung up, stop waiting for it
        self._poll.register(fd, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        self.peer_prefix: int = meta["prefix"]
        self.prefix = worker.new_prefix()
        self._posted: dict[BlockKey, Any] = {}  # RESERVE's receives, by key, until COMMIT

    def _hung(self) -> bool:
        return bool(self._poll.poll(0))

    def hello(self) -> dict[str, Any]:
        """The UCX op's answer: this daemon's worker and the prefix of tags it receives."""
        return {"address": self._worker.address.hex(), "prefix": self.prefix}

    def send_blocks(self, rid: int, views: Sequence[Any], indices: Sequence[int],
                    deadline: float) -> None:
        """Send ``views[j]`` as block ``indices[j]`` of request ``rid``; wait for all."""
        tags = [ucx.tag(self.peer_prefix, rid, i) for i in indices]
        ucx.wait(self.ep.send(views, tags), deadline, abort=self._hung)

    def post(self, rid: int, keys: Sequence[BlockKey], views: Sequence[Any],
             indices: Sequence[int]) -> None:
        """Receive block ``indices[j]`` of request ``rid`` into ``views[j]`` (``keys[j]``'s slot)."""
        reqs = self.ep.recv(views, [ucx.tag(self.prefix, rid, i) for i in indices])
        self._posted.update(zip(keys, reqs))

    def posted(self, keys: Sequence[BlockKey]) -> bool:
        return any(k in self._posted for k in keys)

    def take(self, keys: Sequence[BlockKey], timeout: float) -> None:
        """Wait for the posted receives of ``keys`` (those that have one)."""
        reqs = [self._posted.pop(k) for k in keys if k in self._posted]
        ucx.wait(reqs, time.monotonic() + timeout, abort=self._hung)

    def close(self) -> bool:
        """Close the endpoint, cancelling what is posted; True when nothing is left in flight."""
        self._posted.clear()
        return self.ep.close()
