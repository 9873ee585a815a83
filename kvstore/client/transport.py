"""Which data path a client takes to a store node: the transport matrix, decided here once.

=====================  ==========================  ===========================================
between                path                        needs
=====================  ==========================  ===========================================
client, daemon on the  shared memory (the arena    the daemon's host id matches, its arena maps
same host              mapped; the shared index)   here (``kvstore.client.shm_path``)
client, daemon on      UCX (tagged messages;       the daemon serves it (``kvstore serve
another host           rendezvous, zero copy)      --ucx``: ``"ucx"`` in its registration's
                                                   ``"transports"`` and HELLO's answer), ``ucxx``
                                                   imports here, no TLS
                                                   (``kvstore.client.ucx_path``)
anything else          TCP frames (scatter reads   nothing (``kvstore.net.protocol``); TLS
                       into the caller's buffers)  wraps it where configured
=====================  ==========================  ===========================================

``"auto"`` picks by that table, per connection: a ``Client`` from the daemon's HELLO answer
(``kvstore.net.connection``), a ``ClusterClient`` first from what each node advertises in
etcd (``pick``): a node whose registration lists no UCX is dialled with ``"tcp"`` unless it
is on this host. ``"tcp"``, ``"shm"`` and ``"ucx"`` force one path (a node that cannot serve
it is unreachable to that client). The daemon's own clients (re-replication, drains) choose
the same way, so daemon-to-daemon copies take UCX where both ends serve it.

CUDA IPC (``kvstore.client.cuda_path``) is no connection's path but two calls of ``Client``,
``get_cuda``/``put_cuda``, beside whichever path the connection took: the daemon's GPU tier
mapped into this process, offered by a daemon with a CUDA GPU tier (``"cuda_ipc"`` in its
registration's ``"transports"`` and HELLO's answer) to clients on its host.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from kvstore.net import ucx
from kvstore.net.host_id import local_host_id

__all__ = ["Transport", "TRANSPORTS", "pick"]

Transport = Literal["auto", "tcp", "shm", "ucx"]
TRANSPORTS: tuple[Transport, ...] = ("auto", "tcp", "shm", "ucx")


def pick(member: Mapping[str, Any] | None, want: Transport, tls: bool = False) -> Transport:
    """The transport to dial a node with, from its registration ``member`` (module docstring)."""
    if want != "auto" or member is None:
        return want
    if member.get("host_id") == local_host_id():
        return "auto"  # shared memory where the arena maps, as the HELLO answer tells
    if "ucx" in (member.get("transports") or ()) and not tls and ucx.available() is None:
        return "auto"  # the HELLO answer offers UCX
    return "tcp"
