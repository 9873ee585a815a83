"""Certificates to try TLS with: a cluster CA and per-node certificates (``kvstore certs make``).

``make_certs(DIR, names=("node",), ips=(), dns=())`` writes, with the ``openssl`` command
(no Python dependency)::

    DIR/ca.pem, DIR/ca-key.pem          the cluster CA (made once: kept if already there)
    DIR/NAME.pem, DIR/NAME-key.pem      one certificate per name, signed by the CA

and returns ``{name: TLSConfig}`` (``kvstore.tls``). Keys are P-256 EC, written 0600. Every
node certificate is good for both ends of a connection (extendedKeyUsage serverAuth and
clientAuth: etcd's gateway dials its own gRPC port with it) and names 127.0.0.1, ::1,
localhost, the name itself and every ``ips``/``dns`` given in its subjectAltName, which
clients check against the host they connect to.

The command line::

    kvstore certs make DIR [--name NAME ...] [--ip ADDR ...] [--dns NAME ...]

prints the flags that use them. For production, use your own PKI; these are for trying.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

from kvstore.tls import TLSConfig, TLSError

__all__ = ["add_certs_command", "make_ca", "make_certs", "make_node"]

DEFAULT_DAYS = 825
_CURVE = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise TLSError("making certificates needs the `openssl` command, which is not on PATH")
    proc = subprocess.run([exe, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise TLSError(f"openssl {args[0]} failed: {proc.stderr.strip()[-500:]}")


def _private(path: Path) -> None:
    os.chmod(path, 0o600)


def make_ca(directory: str | os.PathLike[str], *, days: int = DEFAULT_DAYS,
            subject: str = "kvcache cluster CA") -> tuple[Path, Path]:
    """``DIR/ca.pem`` and ``DIR/ca-key.pem``, made unless both exist; returns their paths."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cert, key = d / "ca.pem", d / "ca-key.pem"
    if cert.is_file() and key.is_file():
        return cert, key
    _openssl("req", "-x509", *_CURVE, "-keyout", str(key), "-out", str(cert), "-days", str(days),
             "-subj", f"/CN={subject}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    _private(key)
    return cert, key


def _san(name: str, ips: Iterable[str], dns: Iterable[str]) -> str:
    entries = ["IP:127.0.0.1", "IP:::1", "DNS:localhost"]
    for ip in ips:
        entries.append(f"IP:{ipaddress.ip_address(ip.strip('[]'))}")
    for host in [name, *dns]:
        try:
            entries.append(f"IP:{ipaddress.ip_address(host)}")
        except ValueError:
            entries.append(f"DNS:{host}")
    return ",".join(dict.fromkeys(entries))


def make_node(directory: str | os.PathLike[str], name: str = "node", *, ips: Iterable[str] = (),
              dns: Iterable[str] = (), days: int = DEFAULT_DAYS) -> TLSConfig:
    """``DIR/NAME.pem`` and ``DIR/NAME-key.pem`` signed by the CA in ``DIR`` (made first if
    missing); returns the ``TLSConfig`` that uses them. Made again on every call."""
    d = Path(directory)
    if not name or "/" in name or name.startswith("."):
        raise TLSError(f"a certificate name must be a plain file name, got {name!r}")
    ca_cert, ca_key = make_ca(d, days=days)
    cert, key = d / f"{name}.pem", d / f"{name}-key.pem"
    with tempfile.TemporaryDirectory(prefix="kvcerts-") as tmp:
        csr, ext = Path(tmp) / "node.csr", Path(tmp) / "ext.cnf"
        ext.write_text("basicConstraints=critical,CA:FALSE\n"
                       "keyUsage=critical,digitalSignature,keyEncipherment\n"
                       "extendedKeyUsage=serverAuth,clientAuth\n"
                       f"subjectAltName={_san(name, ips, dns)}\n")
        _openssl("req", "-new", *_CURVE, "-keyout", str(key), "-out", str(csr),
                 "-subj", f"/CN={name}")
        _private(key)
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
                 "-set_serial", str(secrets.randbits(63)), "-days", str(days), "-sha256",
                 "-extfile", str(ext), "-out", str(cert))
    return TLSConfig.from_dir(d, name).check()


def make_certs(directory: str | os.PathLike[str], *, names: Iterable[str] = ("node",),
               ips: Iterable[str] = (), dns: Iterable[str] = (),
               days: int = DEFAULT_DAYS) -> dict[str, TLSConfig]:
    """The CA (kept if there) and one certificate per name (module docstring)."""
    ips, dns = list(ips), list(dns)
    return {n: make_node(directory, n, ips=ips, dns=dns, days=days) for n in (list(names) or ["node"])}


def _make(args: argparse.Namespace) -> int:
    made = make_certs(args.dir, names=args.name or ["node"], ips=args.ip, dns=args.dns, days=args.days)
    print(f"CA: {Path(args.dir) / 'ca.pem'} (its key ca-key.pem: keep it off the nodes)")
    for name, cfg in made.items():
        print(f"{name}: {' '.join(cfg.args())}")
    return 0


def add_certs_command(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``certs make DIR`` to a command's subcommands (``kvstore certs make``)."""
    c = sub.add_parser("certs", help="make a CA and node certificates to try TLS with")
    csub = c.add_subparsers(dest="certs_command", required=True)
    m = csub.add_parser("make", help="write DIR/ca.pem and DIR/NAME.pem + DIR/NAME-key.pem")
    m.add_argument("dir", help="directory to write them to (created; an existing CA is kept)")
    m.add_argument("--name", action="append", default=[],
                   help="a certificate per name (repeatable; default: one called node)")
    m.add_argument("--ip", action="append", default=[],
                   help="an address every certificate is good for, beside 127.0.0.1 and ::1 "
                        "(repeatable: the hosts' addresses clients connect to)")
    m.add_argument("--dns", action="append", default=[],
                   help="a host name every certificate is good for, beside localhost (repeatable)")
    m.add_argument("--days", type=int, default=DEFAULT_DAYS, help=f"validity (default {DEFAULT_DAYS})")
    m.set_defaults(fn=_make, log_level="WARNING")
