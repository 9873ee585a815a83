"""``ServerLimits``: what one store daemon allows its clients (``kvstore serve`` flags).

Kept apart from ``kvstore.net.server`` so that the daemon's configuration can hold one
without loading the server (``kvstore --help`` stays quick).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ServerLimits"]


@dataclass(frozen=True)
class ServerLimits:
    """What one daemon allows its clients (``kvstore serve`` flags of the same names).

    ``max_conn_reserve`` bytes (0: ``conn_reserve_fraction`` of the arena) is what one
    connection may hold reserved at once (a PUT in flight plus uncommitted RESERVEs);
    clients learn it as HELLO's ``max_data`` and split their puts to fit.
    """

    max_connections: int = 8192
    hello_timeout: float = 5.0
    idle_timeout: float = 300.0
    frame_timeout: float = 30.0
    max_conn_reserve: int = 0
    conn_reserve_fraction: float = 0.25
    threads: int = 32

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.threads < 1:
            raise ValueError("--max-connections and --threads must be at least 1")
        if min(self.hello_timeout, self.idle_timeout, self.frame_timeout) <= 0:
            raise ValueError("--hello-timeout, --idle-timeout and --frame-timeout must be positive")
        if self.max_conn_reserve < 0 or not 0 < self.conn_reserve_fraction <= 1:
            raise ValueError("--max-conn-reserve must be a size or a fraction of the arena in (0, 100%]")
