"""The address a server registers: the one other hosts reach it at.

A server bound to one address advertises that address. A server bound to a wildcard
(``0.0.0.0``, ``::``, ``""``) is reachable at every address of its host, so it advertises
one: ``--advertise-address`` when given, else the host's primary non-loopback address, read
as the source address the kernel picks for a route out (a UDP socket ``connect``-ed to a
documentation address, 192.0.2.1: a UDP connect sends nothing), else
``gethostbyname(gethostname())``, else ``127.0.0.1``. The store daemon (``kvstore serve``)
and the engine worker (``kvengine serve``) both decide it here.
"""

from __future__ import annotations

import socket

__all__ = ["WILDCARDS", "is_wildcard", "primary_address", "advertised_host", "join_host_port"]

WILDCARDS = ("0.0.0.0", "::", "")
_PROBE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never routed, and a UDP connect sends no packet


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in WILDCARDS


def primary_address() -> str:
    """This host's primary non-loopback IPv4 address (module docstring), or 127.0.0.1."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((_PROBE, 9))
            address = s.getsockname()[0]
        if address and not address.startswith("127.") and address != "0.0.0.0":
            return address
    except OSError:
        pass
    try:
        address = socket.gethostbyname(socket.gethostname())
        if not address.startswith("127."):
            return address
    except OSError:
        pass
    return "127.0.0.1"


def advertised_host(bind_host: str, advertise_address: str | None = None) -> str:
    """What a server bound to ``bind_host`` registers (module docstring)."""
    if advertise_address:
        return advertise_address
    return primary_address() if is_wildcard(bind_host) else bind_host


def join_host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
