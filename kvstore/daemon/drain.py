"""Draining a store node: it stops taking new blocks, hands what it holds on, then leaves.

The request is a key in etcd, ``/{cluster}/drain/{node_id}`` (``kvstore.coord.layout``), put by
``kvstore drain NODE`` with ``{"state": "requested"}`` and watched by the node (``Drainer``).
The node then, in order:

1. writes ``{"state": "draining"}`` and sets ``"draining": true`` in its registration: every
   ``ClusterClient`` ranks it out of the write targets at once (watch latency) while reads
   still reach it, so no request fails and none writes to it again (``View``);
2. waits until its own client sees the flag, and ``SETTLE`` seconds more for other clients'
   watches and the writes they had in flight;
3. runs re-replication passes with ``drain=True`` (``kvstore.daemon.repair``: every block
   whose targets lack it is pushed there) until a pass finds nothing to push, at most
   ``MAX_PASSES``; progress (``passes``, ``pushed_blocks``, ``pushed_bytes``, ``pending``) goes
   into the drain key after each pass;
4. on success writes ``{"state": "done", ...}`` and calls ``on_done``: ``kvstore serve`` then
   stops as on SIGTERM (stop accepting, deregister, finish in-flight requests) and exits 0.
   If blocks had no node to go to or could not be pushed, it writes ``{"state": "failed",
   "error": ...}``, clears its draining flag and keeps serving.

The key has no lease, so a request made while the node restarts is still there when it comes
back. At start a node deletes a ``done`` or ``failed`` record of its own (a finished drain, so a
restarted node does not drain again) and acts on ``requested`` or ``draining`` (a drain that
a crash interrupted is resumed). ``kvstore drain`` deletes the record once it has seen it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvstore.coord import layout
from kvstore.coord.etcd import EtcdClient, EtcdError
from kvstore.coord.membership import Membership, MembershipChange
from kvstore.coord.registration import Registration
from kvstore.daemon.repair import Repairer

__all__ = ["Drainer", "SETTLE", "MAX_PASSES", "ACTIVE", "FINISHED"]

log = logging.getLogger(__name__)

SETTLE = 0.5
MAX_PASSES = 5
ACTIVE = ("requested", "draining")
FINISHED = ("done", "failed")


class Drainer:
    """Watches this node's drain key and drains when asked (module docstring)."""

    def __init__(self, etcd: EtcdClient, cluster: str, node_id: str, registration: Registration,
                 value: Mapping[str, Any], repairer: Repairer, on_done: Callable[[], None]) -> None:
        self._etcd = etcd
        self.key = layout.drain_key(cluster, node_id)
        self.node_id = node_id
        self._registration = registration
        self._value = dict(value)
        self._repairer = repairer
        self._on_done = on_done
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch = Membership(etcd, layout.drain_prefix(cluster), on_change=self._on_change)

    def start(self) -> "Drainer":
        raw = self._etcd.get(self.key)
        if raw is not None and _state(raw) in FINISHED:
            self._etcd.delete(self.key)  # a finished drain of an earlier run
        self._watch.start()  # its first read reports a pending request
        return self

    def close(self) -> None:
        self._watch.close()

    def _on_change(self, change: MembershipChange) -> None:
        mine = change.members.get(self.node_id)
        if mine is None or mine.get("state") not in ACTIVE or self._started.is_set():
            return
        self._started.set()
        self._thread = threading.Thread(target=self._run, name="kvstore-drain", daemon=True)
        self._thread.start()

    def _report(self, state: str, **fields: Any) -> None:
        try:
            self._etcd.put(self.key, json.dumps({"state": state, "node_id": self.node_id,
                                                 "at": time.time(), **fields}))
        except EtcdError as exc:
            log.warning("cannot report drain progress to etcd: %s", exc)

    def _run(self) -> None:
        log.info("draining: no new blocks; handing what this node holds to the other nodes")
        self._report("draining", pending=len(self._repairer.store.held_keys()))
        try:
            self._registration.update({**self._value, "draining": True})
            cluster = self._repairer.cluster
            assert cluster is not None
            deadline = time.monotonic() + 5.0
            while self.node_id not in cluster.draining and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(SETTLE)
            pushed = pushed_bytes = n = 0
            result = None
            for n in range(1, MAX_PASSES + 1):
                result = self._repairer.run_pass(drain=True)
                pushed += result.pushed
                pushed_bytes += result.pushed_bytes
                self._report("draining", passes=n, pushed_blocks=pushed, pushed_bytes=pushed_bytes,
                             pending=result.pushed + result.failed + result.no_target)
                if not (result.pushed or result.failed or result.no_target):
                    break
                if result.no_target:
                    break
            assert result is not None
            if result.no_target or result.failed or result.pushed:
                why = (f"{result.no_target} blocks have no other node to go to"
                       if result.no_target else
                       f"{result.failed + result.pushed} blocks still not on their new owners "
                       f"after {MAX_PASSES} passes")
                raise RuntimeError(why)
        except Exception as exc:  # noqa: BLE001 - reported, and the node keeps serving
            log.error("drain failed: %s; serving again", exc)
            self._report("failed", error=str(exc))
            try:
                self._registration.update(self._value)
            except EtcdError:
                pass
            self._started.clear()
            return
        log.info("drained: %d blocks (%d bytes) handed over; leaving the cluster", pushed,
                 pushed_bytes)
        self._report("done", pushed_blocks=pushed, pushed_bytes=pushed_bytes, passes=n)
        self._on_done()


def _state(raw: bytes) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value.get("state") if isinstance(value, dict) else None
