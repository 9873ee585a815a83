"""The cluster secret: the one token that every internal server of a cluster checks.

Every server that is not the public endpoint (store daemons, engine workers) requires it of
every caller, and every internal caller (store clients, the router's calls to workers) sends
it. ``/health`` and ``/metrics`` are the only things served without it.

Where a process finds it, first found wins:

1. ``--cluster-secret-file PATH``: a file holding the secret (surrounding whitespace
   stripped), e.g. a mounted Kubernetes secret. The way to hand it to a process: nothing
   shows up on a command line.
2. ``--cluster-secret VALUE``: for quick tries; a command line is visible to ``ps``.
3. ``$KVCACHE_CLUSTER_SECRET``: the value (how ``kvrouter up`` hands it to its children).
4. ``$KVCACHE_CLUSTER_SECRET_FILE``: a path, as 1.

No secret means no authentication, which a server accepts only on loopback:
:func:`check_bind` refuses to bind any other address without a secret unless the operator
says ``--insecure``.

On the wire: the store's HELLO frame carries it (``kvstore.net.protocol``); HTTP requests
carry ``Authorization: Bearer <secret>`` (:func:`bearer_headers`; the servers check it with
``kvstore.http_auth.BearerGate``, in constant time).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "ENV",
    "ENV_FILE",
    "InsecureBind",
    "SecretError",
    "add_secret_flags",
    "bearer_headers",
    "check_bind",
    "generate",
    "is_loopback",
    "read_secret_file",
    "resolve",
    "write_secret_file",
]

ENV = "KVCACHE_CLUSTER_SECRET"
ENV_FILE = "KVCACHE_CLUSTER_SECRET_FILE"


class SecretError(ValueError):
    """The secret could not be read (a missing, empty or unreadable file)."""


class InsecureBind(ValueError):
    """A server was asked to listen beyond loopback with no secret and no ``--insecure``."""


def read_secret_file(path: str | os.PathLike[str]) -> str:
    """The secret in ``path``, surrounding whitespace stripped; :class:`SecretError` if the
    file is missing, unreadable or empty."""
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise SecretError(f"cannot read the cluster secret file {os.fspath(path)!r}: {exc.strerror}") from None
    if not value:
        raise SecretError(f"the cluster secret file {os.fspath(path)!r} is empty")
    return value


def resolve(value: str | None = None, file: str | os.PathLike[str] | None = None,
            environ: Mapping[str, str] | None = None) -> str | None:
    """The cluster secret from a flag's file, a flag's value, then the environment (see the
    module docstring for the order); None when none of them gives one."""
    env = os.environ if environ is None else environ
    if file:
        return read_secret_file(file)
    if value:
        return value
    if env.get(ENV):
        return env[ENV]
    if env.get(ENV_FILE):
        return read_secret_file(env[ENV_FILE])
    return None


def add_secret_flags(parser: argparse.ArgumentParser, *, server: bool = True) -> None:
    """Add ``--cluster-secret-file`` and ``--cluster-secret`` (and, for servers,
    ``--insecure``) to ``parser``; read them back with :func:`resolve`."""
    parser.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                        help=f"file holding the cluster secret (default: ${ENV_FILE}); "
                             "the way to pass it without showing it on a command line")
    parser.add_argument("--cluster-secret", default=None, metavar="SECRET",
                        help=f"the cluster secret itself (default: ${ENV}); visible to ps, "
                             "prefer --cluster-secret-file")
    if server:
        parser.add_argument("--insecure", action="store_true",
                            help="allow listening on a non-loopback address without a cluster "
                                 "secret (anyone who reaches the port is then served)")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1); False for a
    wildcard (``0.0.0.0``, ``::``, ``""``) and every other name or address."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, secret: str | None, insecure: bool = False, *, what: str = "server") -> None:
    """Refuse (:class:`InsecureBind`) to serve beyond loopback without a secret, unless
    ``insecure``."""
    if secret or insecure or is_loopback(host):
        return
    raise InsecureBind(
        f"refusing to serve the {what} on {host or '*'} without a cluster secret: anyone who "
        f"reaches it would be served. Pass --cluster-secret-file PATH (or set ${ENV}), bind "
        "127.0.0.1, or say --insecure")


def generate() -> str:
    """A fresh secret: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def write_secret_file(path: str | os.PathLike[str], secret: str) -> Path:
    """Write ``secret`` to ``path`` readable by its owner only (0600, created so: never
    briefly world-readable); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(secret + "\n")
    return p


def bearer_headers(secret: str | None) -> dict[str, str]:
    """The HTTP headers an internal caller sends: ``Authorization: Bearer <secret>``."""
    return {"Authorization": f"Bearer {secret}"} if secret else {}
