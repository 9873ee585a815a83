"""The daemon's configuration: one typed object, validated once, defaults in one place.

The CLI (``kvstore serve``) and the environment (the cluster secret, ``kvstore.secret``; the
deprecated ``KVSTORE_AUTH_TOKEN``) both feed ``ServerConfig``; nothing else sets daemon
options.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.coord.registration import DEFAULT_TTL
from kvstore.net.address import is_wildcard
from kvstore.net.limits import ServerLimits
from kvstore.secret import check_bind

if TYPE_CHECKING:
    from kvstore.node.ssd_tier import CorruptSsdPolicy
    from kvstore.tls import TLSConfig

__all__ = ["ServerConfig", "parse_size", "format_size", "DEFAULT_PORT"]

DEFAULT_PORT = 7700
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``512M``, ``4G``, ``1.5GiB``, ``65536`` (binary units)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 512M, 4G or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: int) -> str:
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit] and n % (_UNITS[unit] // 1024 or 1) == 0:
            return f"{n / _UNITS[unit]:.1f}{unit}iB"
    return f"{n}B"


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``kvstore serve`` takes.

    ``port`` 0 binds an ephemeral port (the readiness line reports it). ``advertise_address`` is the
    address other hosts reach the node at (registered in etcd with the bound port; by
    default ``host``, or the host's primary address when ``host`` is a wildcard:
    ``kvstore.net.address``); ``advertise`` a whole ``host:port`` registered as given.
    ``auth_token`` is the cluster secret (``kvstore.secret``); without one only a loopback
    ``host`` is served, unless ``insecure``. ``limits`` are what
    one daemon allows its clients (``ServerLimits``: connections, timeouts, the
    per-connection reservation cap, serving threads). ``on_corrupt_ssd``: what a damaged
    SSD tier at start does ("move-aside": moved to a named directory beside it, started
    empty; "fail": the daemon does not start). ``shared_index``: publish the host tier's index
    in shared memory for same-host gets with no round trip (``kvstore.node.shared_index``;
    ``--no-shared-index`` turns it off). ``drain_timeout`` is how long SIGTERM waits for
    in-flight operations. ``tls``: serve TLS with mutual certificates (``kvstore.tls``).
    ``ucx``: also serve the UCX data path (``kvstore.net.ucx``; needs ``ucxx``, not with TLS).
    ``registration_ttl`` is the etcd lease TTL in seconds (etcd grants
    whole seconds: it is rounded up, at least 1); a dead node leaves etcd within it.
    ``node_id`` names the node (``kvstore.daemon.identity``: kept in the SSD directory; a
    conflict with the kept one is refused). ``replicas`` seeds the cluster's R in etcd when it
    has none (``kvstore.coord.settings.seed``). ``repair_rate`` (bytes/s; 0: no background
    passes), ``repair_interval`` and ``repair_settle`` (seconds) drive re-replication
    (``kvstore.daemon.repair``).
    """

    memory_bytes: int
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    ssd_path: str | None = None
    ssd_capacity_bytes: int = 0
    gpu_memory_bytes: int = 0
    etcd: str | None = None
    cluster: str = "kvstore"
    auth_token: str | None = None
    metrics_port: int | None = None
    advertise: str | None = None
    advertise_address: str | None = None
    registration_ttl: float = DEFAULT_TTL
    insecure: bool = False
    limits: ServerLimits = field(default_factory=ServerLimits)
    on_corrupt_ssd: CorruptSsdPolicy = "move-aside"
    shared_index: bool = True
    drain_timeout: float = 10.0
    tls: TLSConfig | None = None
    node_id: str | None = None
    replicas: int | None = None
    repair_rate: int = 64 << 20
    repair_interval: float = 600.0
    repair_settle: float = 0.5
    ucx: bool = False

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"--memory must be positive, got {self.memory_bytes}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.ssd_capacity_bytes < 0 or self.gpu_memory_bytes < 0:
            raise ValueError("--ssd-capacity and --gpu-memory must not be negative")
        if self.ssd_capacity_bytes and not self.ssd_path:
            raise ValueError("--ssd-capacity needs --ssd-path (the LMDB directory)")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        if not self.cluster or "/" in self.cluster:
            raise ValueError(f"--cluster must be a non-empty name without '/', got {self.cluster!r}")
        if not self.registration_ttl > 0:
            raise ValueError(f"--registration-ttl must be positive seconds, got {self.registration_ttl}")
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout must not be negative")
        if self.on_corrupt_ssd not in ("move-aside", "fail"):
            raise ValueError(f"--on-corrupt-ssd must be move-aside or fail, got {self.on_corrupt_ssd!r}")
        if self.advertise and self.advertise_address:
            raise ValueError("give --advertise (host:port) or --advertise-address, not both")
        if self.advertise_address is not None and is_wildcard(self.advertise_address):
            raise ValueError(f"--advertise-address must be an address others reach, got "
                             f"{self.advertise_address!r}")
        if self.replicas is not None and self.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {self.replicas}")
        if self.repair_rate < 0 or self.repair_interval < 0 or self.repair_settle < 0:
            raise ValueError("--repair-rate, --repair-interval and --repair-settle must not be "
                             "negative")
        if self.replicas is not None and not self.etcd:
            raise ValueError("--replicas needs --etcd (it is the cluster's setting in etcd)")
        check_bind(self.host, self.auth_token, self.insecure, what="store daemon")
        if self.ucx:
            if self.tls is not None:
                raise ValueError("--ucx moves block bytes unencrypted: it cannot be combined with TLS")
            from kvstore.net import ucx

            reason = ucx.available()
            if reason is not None:
                raise ValueError(f"--ucx: {reason}")
