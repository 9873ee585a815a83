"""Cluster membership in etcd: watch who is registered under one prefix.

The keys are those of ``kvstore.coord.layout`` (``/{cluster}/{kind}/{id}``, one JSON object
each), put under a lease by ``kvstore.coord.registration``: a member that dies leaves within
its TTL.

``Membership`` mirrors one prefix: ``start()`` reads it (raising ``EtcdUnavailable`` if etcd
  cannot be reached then), then a daemon thread watches from the next revision. When the
  watch breaks it reconnects and resynchronizes from a fresh read, reporting the difference
  as one change. While etcd is unreachable ``healthy`` is False, ``last_error`` says why, and
  ``members()`` keeps the last known view. ``on_change`` runs on the watch thread, after the
  view is updated; it must not block for long.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.coord.etcd import EtcdClient, EtcdError, Watch, WatchCompacted, WatchEvent, client_for

__all__ = ["Membership", "MembershipChange"]

log = logging.getLogger(__name__)

Members = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class MembershipChange:
    """What changed in one step; ``members`` is the whole view after it."""

    joined: Members = field(default_factory=dict)
    left: Members = field(default_factory=dict)
    updated: Members = field(default_factory=dict)
    members: Members = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.joined or self.left or self.updated)


class Membership:
    """The live members under ``prefix``: ``{id: value}`` with id = key suffix after prefix."""

    def __init__(
        self,
        etcd: EtcdClient | str,
        prefix: str,
        on_change: Callable[[MembershipChange], None] | None = None,
        *,
        retry_interval: float = 0.5,
        probe_interval: float = 2.0,
    ) -> None:
        self._etcd, self._owns_etcd = client_for(etcd)
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._on_change = on_change
        self._retry_interval = retry_interval
        self._probe_interval = probe_interval
        self._members: Members = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._watch: Watch | None = None
        self._thread: threading.Thread | None = None
        self._healthy = False
        self.last_error: Exception | None = None
        self.revision = 0

    # -- the view -------------------------------------------------------------------------

    def members(self) -> Members:
        """A snapshot of the current members (treat the values as read-only)."""
        with self._cond:
            return dict(self._members)

    @property
    def healthy(self) -> bool:
        """False while etcd cannot be reached (the view is then the last one known)."""
        return self._healthy

    def wait_for(self, predicate: Callable[[Members], bool], timeout: float) -> bool:
        """Block until ``predicate(members())`` is true (re-checked on every change and every
        health change); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(dict(self._members)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> "Membership":
        if self._thread is not None:
            raise RuntimeError(f"membership of {self.prefix} already started")
        self._resync()
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-membership:{self.prefix}", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching. Idempotent."""
        self._stop.set()
        with self._cond:
            watch = self._watch
        if watch is not None:
            watch.close()
        if self._thread is not None:
            self._thread.join(timeout=self._etcd.timeout + self._probe_interval + 1.0)
        if self._owns_etcd:
            self._etcd.close()

    def __enter__(self) -> "Membership":
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the watch thread -----------------------------------------------------------------

    def _decode(self, key: str, raw: bytes) -> tuple[str, dict[str, Any]] | None:
        member_id = key[len(self.prefix):]
        try:
            value = json.loads(raw)
        except ValueError:
            log.warning("ignoring %s: its value is not JSON", key)
            return None
        if not member_id or not isinstance(value, dict):
            log.warning("ignoring %s: not a member record", key)
            return None
        return member_id, value

    def _resync(self) -> None:
        """Replace the view by a fresh read of the prefix; report the difference."""
        kvs, revision = self._etcd.get_prefix(self.prefix)
        fresh: Members = {}
        for key, raw in kvs.items():
            if (decoded := self._decode(key, raw)) is not None:
                fresh[decoded[0]] = decoded[1]
        with self._cond:
            old = self._members
            change = MembershipChange(
                joined={k: v for k, v in fresh.items() if k not in old},
                left={k: v for k, v in old.items() if k not in fresh},
                updated={k: v for k, v in fresh.items() if k in old and old[k] != v},
                members=dict(fresh),
            )
            self._members = fresh
            self.revision = revision
        self._set_health(True, None)
        self._notify(change)

    def _apply(self, event: WatchEvent) -> None:
        with self._cond:
            self.revision = max(self.revision, event.mod_revision)
            if event.type == "delete":
                member_id = event.key[len(self.prefix):]
                if member_id not in self._members:
                    return
                gone = self._members.pop(member_id)
                change = MembershipChange(left={member_id: gone}, members=dict(self._members))
            else:
                decoded = self._decode(event.key, event.value)
                if decoded is None:
                    return
                member_id, value = decoded
                old = self._members.get(member_id)
                if old == value:
                    return
                self._members[member_id] = value
                kind = "joined" if old is None else "updated"
                change = MembershipChange(
                    **{kind: {member_id: value}}, members=dict(self._members)
                )
        self._notify(change)

    def _notify(self, change: MembershipChange) -> None:
        with self._cond:
            self._cond.notify_all()
        if change and self._on_change is not None:
            try:
                self._on_change(change)
            except Exception:  # a faulty callback must not kill the watch
                log.exception("membership on_change callback failed")

    def _set_health(self, healthy: bool, error: Exception | None) -> None:
        with self._cond:
            self._healthy = healthy
            self.last_error = error
            self._cond.notify_all()

    def _run(self) -> None:
        synced = True  # start() just read the prefix
        while not self._stop.is_set():
            try:
                if not synced:
                    self._resync()
                watch = self._etcd.watch_prefix(
                    self.prefix, self.revision + 1, probe_interval=self._probe_interval
                )
                with self._cond:
                    self._watch = watch
                if self._stop.is_set():
                    watch.close()
                    break
                for event in watch:
                    self._apply(event)
                synced = False  # ended without an error: closed by us, or etcd went away
            except WatchCompacted:
                synced = False  # our revision is gone: a fresh read catches up
            except EtcdError as exc:
                synced = False
                if self._stop.is_set():
                    break
                if self._healthy:
                    log.warning("lost the etcd watch on %s: %s", self.prefix, exc)
                self._set_health(False, exc)
                self._stop.wait(self._retry_interval)
            except Exception as exc:  # keep the last view rather than die silently
                synced = False
                log.exception("membership watch on %s failed", self.prefix)
                self._set_health(False, exc)
                self._stop.wait(self._retry_interval)
