"""This machine's identity as the daemon and its clients compare it in HELLO (shared memory
is offered only to a client whose host id matches the daemon's)."""

from __future__ import annotations

import socket

__all__ = ["local_host_id"]


def local_host_id() -> str:
    """This machine's identity as the daemon and clients compare it (hex).

    Same boot id and hostname: the same kernel and, in practice, the same ``/dev/shm``. A
    client that matches still verifies that it can map the arena before it uses it.
    """
    import xxhash

    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        boot = b""
    return xxhash.xxh3_128(boot + b"\0" + socket.gethostname().encode()).hexdigest()
