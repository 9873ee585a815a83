"""Typed exceptions of the kvstore API. Each says what went wrong and what to do about it.

Callers never see integer status codes: the wire protocol carries an error code, and the
client turns it back into one of these classes (see ``protocol.py``).
"""

from __future__ import annotations

__all__ = [
    "KVStoreError",
    "StoreUnavailable",
    "StoreFull",
    "CorruptBlock",
    "AuthError",
    "ProtocolError",
    "Unsupported",
    "EtcdError",
    "EtcdUnavailable",
    "LeaseExpired",
    "WatchCompacted",
    "ETCD_START_HINT",
]

ETCD_START_HINT = (
    "is etcd running there? Start one with `etcd --listen-client-urls http://127.0.0.1:2379 "
    "--advertise-client-urls http://127.0.0.1:2379` or pass the right --etcd URL"
)


class KVStoreError(Exception):
    """Base class of every error the kvstore raises at its API edge."""


class StoreUnavailable(KVStoreError):
    """No store node could be reached (dead daemon, refused connection, timeout, no members).

    The operation did not happen. Callers that cache treat it as a miss and recompute; check
    that `kvstore serve` is running at the address (or registered in etcd) and reachable.
    """


class StoreFull(KVStoreError):
    """A put could not fit even after evicting every evictable block. Nothing was stored.

    Raise the node's `--memory`/`--ssd-capacity`, add nodes, or put fewer blocks at once.
    """


class CorruptBlock(KVStoreError):
    """A block failed verification (bad magic, wrong key, checksum mismatch, truncated).

    A corrupt block is a miss: recompute it. It is never handed to a model.
    """


class AuthError(KVStoreError):
    """The daemon refused the client's token. Pass the daemon's `--auth-token`
    (or set KVSTORE_AUTH_TOKEN) on the client."""


class ProtocolError(KVStoreError):
    """A peer sent something that is not valid protocol (bad magic or version, absurd length,
    unknown operation, truncated frame). The connection is closed; reconnect and retry, and
    check that client and daemon run the same protocol version."""


class Unsupported(KVStoreError):
    """The daemon or this machine cannot do what was asked: a data path it does not offer
    (CUDA IPC from a daemon without a CUDA GPU tier, or from another host) or one that needs
    CUDA where there is none. Nothing happened; the connection stays usable. Take another
    path (``Client.get``/``put`` stage CUDA tensors through host memory)."""


class EtcdError(KVStoreError):
    """etcd refused or failed a request (the message carries etcd's own reason)."""


class EtcdUnavailable(EtcdError, StoreUnavailable):
    """No etcd endpoint could be reached, or etcd has no leader. Retry later."""


class LeaseExpired(EtcdError):
    """The lease expired or never existed: grant a new one (and re-put its keys)."""


class WatchCompacted(EtcdError):
    """The watch start revision was compacted away: re-read the range and watch again."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision
