"""TLS with mutual certificates on every internal connection: the settings and the contexts.

Off by default. When on, every internal connection is TLS (1.2 or later; 1.3 where both ends
have it) and *both* ends present a certificate signed by the cluster's CA:

- the store's TCP protocol (``kvstore serve`` and its clients, ``kvstore.net``); the
  shared-memory path on one host stays as it is (its values never cross a network), its
  control channel (HELLO, PIN, RESERVE...) runs on the same TLS connection;
- the worker HTTP API (``kvengine serve``) and the router's calls to it;
- etcd (``kvstore.coord.etcd``: its HTTP gateway, and the watch streams).

The cluster secret is still checked on every one of them (``kvstore.secret``): TLS says who
may connect at all and keeps the bytes private; the secret stays the authorization.

Where a process finds its settings (each of the three separately, flag first):

==============  ======================  ===========================================
flag            environment             what
==============  ======================  ===========================================
``--tls-cert``  ``$KVCACHE_TLS_CERT``   this process's certificate (PEM, chain allowed)
``--tls-key``   ``$KVCACHE_TLS_KEY``    its private key (PEM, unencrypted)
``--tls-ca``    ``$KVCACHE_TLS_CA``     the CA certificate(s) peers must be signed by
==============  ======================  ===========================================

All three or none: one without the others is an error (:class:`TLSError`, a ``ValueError``,
which every command reports in one line and exits 2). So are a missing or unreadable file,
a file that is not PEM, and a key that does not belong to its certificate.

Clients check the server's name: the host of the address they connect to (an IP address or
a DNS name) must be in the server certificate's subjectAltName (``kvstore.certs`` makes them
with 127.0.0.1, ::1, localhost and the addresses given).

A process's settings: a command resolves its flags once and calls :func:`configure`; code
deep in the stack that makes connections on its behalf (``ClusterClient``'s node clients,
a ``Registration``'s etcd client, the router's worker clients) asks :func:`current`, which
is the configured settings, else the environment's. Explicit ``tls=`` arguments win.
"""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ENV_CA", "ENV_CERT", "ENV_KEY", "TLSConfig", "TLSError", "add_tls_flags", "configure",
    "current", "from_args", "resolve",
]

ENV_CERT = "KVCACHE_TLS_CERT"
ENV_KEY = "KVCACHE_TLS_KEY"
ENV_CA = "KVCACHE_TLS_CA"

_FIELDS = (("cert", "--tls-cert", ENV_CERT, "certificate"), ("key", "--tls-key", ENV_KEY, "private key"),
           ("ca", "--tls-ca", ENV_CA, "CA certificate"))


class TLSError(ValueError):
    """TLS settings that cannot work: incomplete, a file missing or unreadable, not PEM, a key
    that is not the certificate's."""


def _read(path: str, flag: str, env: str, what: str) -> None:
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError as exc:
        raise TLSError(f"cannot read the TLS {what} {path!r} ({flag}, ${env}): "
                       f"{exc.strerror}") from None
    if b"-----BEGIN " not in head:
        raise TLSError(f"the TLS {what} {path!r} ({flag}, ${env}) is not a PEM file")


@dataclass(frozen=True)
class TLSConfig:
    """Paths of one process's certificate, its key and the cluster CA (module docstring).

    ``check()`` reads them all (the errors of the module docstring); the contexts are built
    once per set of files (and again when one of them changes on disk).
    """

    cert: str
    key: str
    ca: str

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str], name: str = "node") -> "TLSConfig":
        """The files ``kvstore.certs`` writes: ``DIR/NAME.pem``, ``DIR/NAME-key.pem``,
        ``DIR/ca.pem``."""
        d = Path(directory)
        return cls(str(d / f"{name}.pem"), str(d / f"{name}-key.pem"), str(d / "ca.pem"))

    def check(self) -> "TLSConfig":
        """Read every file and pair the key with the certificate; :class:`TLSError` if not."""
        for (attr, flag, env, what) in _FIELDS:
            _read(getattr(self, attr), flag, env, what)
        self.server_context()
        self.client_context()
        return self

    def server_context(self) -> ssl.SSLContext:
        """A server's context: presents ``cert``, requires a client certificate of ``ca``."""
        return _context(self, True, _mtimes(self))

    def client_context(self) -> ssl.SSLContext:
        """A client's context: presents ``cert``, verifies the server against ``ca`` and its
        name against the host connected to."""
        return _context(self, False, _mtimes(self))

    def environ(self) -> dict[str, str]:
        """The environment a child process finds these settings in."""
        return {ENV_CERT: self.cert, ENV_KEY: self.key, ENV_CA: self.ca}

    def args(self) -> list[str]:
        """The flags that give a command these settings."""
        return ["--tls-cert", self.cert, "--tls-key", self.key, "--tls-ca", self.ca]

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """``uvicorn.Config`` arguments for a server that requires client certificates."""
        return {"ssl_certfile": self.cert, "ssl_keyfile": self.key, "ssl_ca_certs": self.ca,
                "ssl_cert_reqs": ssl.CERT_REQUIRED}


def _mtimes(config: TLSConfig) -> tuple[float, ...]:
    out = []
    for attr, flag, env, what in _FIELDS:
        try:
            out.append(os.stat(getattr(config, attr)).st_mtime)
        except OSError as exc:
            raise TLSError(f"cannot read the TLS {what} {getattr(config, attr)!r} ({flag}, "
                           f"${env}): {exc.strerror}") from None
    return tuple(out)


_CACHE: dict[tuple[TLSConfig, bool], tuple[tuple[float, ...], ssl.SSLContext]] = {}


def _context(config: TLSConfig, server: bool, mtimes: tuple[float, ...]) -> ssl.SSLContext:
    hit = _CACHE.get((config, server))
    if hit is not None and hit[0] == mtimes:
        return hit[1]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    if not server:
        ctx.check_hostname = True
    for attr, flag, env, what in _FIELDS:
        _read(getattr(config, attr), flag, env, what)
    try:
        ctx.load_cert_chain(config.cert, config.key)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise TLSError(f"the TLS key {config.key!r} (--tls-key) is not the key of the "
                           f"certificate {config.cert!r} (--tls-cert)") from None
        raise TLSError(f"cannot load the TLS certificate {config.cert!r} with the key "
                       f"{config.key!r} (--tls-cert, --tls-key): {exc}") from None
    try:
        ctx.load_verify_locations(cafile=config.ca)
    except ssl.SSLError as exc:
        raise TLSError(f"cannot load the TLS CA certificate {config.ca!r} (--tls-ca): {exc}") from None
    _CACHE[(config, server)] = (mtimes, ctx)
    return ctx


def resolve(cert: str | None = None, key: str | None = None, ca: str | None = None,
            environ: Mapping[str, str] | None = None) -> TLSConfig | None:
    """The settings from the flags' values, each falling back to its variable; None when
    none of the three is set anywhere; :class:`TLSError` when only some are."""
    env = os.environ if environ is None else environ
    given = {"cert": cert or env.get(ENV_CERT) or None, "key": key or env.get(ENV_KEY) or None,
             "ca": ca or env.get(ENV_CA) or None}
    if not any(given.values()):
        return None
    missing = [f"{flag} (${e})" for (attr, flag, e, _) in _FIELDS if not given[attr]]
    if missing:
        raise TLSError("--tls-cert, --tls-key and --tls-ca go together; missing "
                       + ", ".join(missing))
    return TLSConfig(str(given["cert"]), str(given["key"]), str(given["ca"])).check()


def from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> TLSConfig | None:
    """:func:`resolve` over the flags :func:`add_tls_flags` added."""
    return resolve(getattr(args, "tls_cert", None), getattr(args, "tls_key", None),
                   getattr(args, "tls_ca", None), environ)


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--tls-cert``, ``--tls-key`` and ``--tls-ca``; read them with :func:`from_args`."""
    parser.add_argument("--tls-cert", default=None, metavar="PEM",
                        help=f"this process's TLS certificate: every internal connection then "
                             f"uses TLS with mutual certificates (default: ${ENV_CERT}; "
                             "with --tls-key and --tls-ca; make them with `kvstore certs make`)")
    parser.add_argument("--tls-key", default=None, metavar="PEM",
                        help=f"the certificate's private key (default: ${ENV_KEY})")
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help=f"the cluster CA that every peer's certificate must be signed by "
                             f"(default: ${ENV_CA})")


_configured: list[TLSConfig | None] = []


def configure(config: TLSConfig | None) -> None:
    """Set this process's settings (a command does, once, from its flags): :func:`current`
    returns them from now on, ``None`` included (TLS off, whatever the environment says)."""
    _configured[:] = [config]


def current() -> TLSConfig | None:
    """This process's settings: what :func:`configure` set, else the environment's."""
    if _configured:
        return _configured[0]
    return resolve()
