"""Hosts: N network hosts on one Linux machine, for multi-host tests and the local launcher.

Each host is a network namespace with its own address on a bridge (a veth pair into it), its
own ``/dev/shm`` (a private tmpfs in a mount namespace) and its own hostname (a UTS
namespace). So no shared memory crosses hosts, and every byte between them crosses a real
network stack; the processes of one host share its ``/dev/shm`` and hostname, as a worker and
a store daemon on one machine do.

Layout of one harness (``k`` is the first subnet octet no live harness uses)::

    root namespace    bridge kvb-<k>, 10.77.<k>.1/24 (reaches every host)
    host i            netns kvh-<pid>-<k>-<i>, eth0 10.77.<k>.<10+i>/24 (peer kvv-<k>-<i> on
                      the bridge), lo up, default route via the bridge; hostname = netns name
    /etc/netns/<netns>  hosts: every host's name and address; resolv.conf: no nameserver, so
                      a name lookup inside a host never leaves the harness (``ip netns exec``
                      bind-mounts these over /etc)

A host's namespaces are held by one long-lived *init* process (``unshare --mount --uts ...
sleep infinity`` inside the netns, after it mounted the tmpfs and set the hostname);
``Host.popen`` starts a process that joins them (``nsenter --target INIT --mount --uts
--net``), in a process group of its own. Only addresses inside namespaces made here are used.

Teardown (``Hosts.close``, also at interpreter exit) kills every process of every host (the
groups it started, then whatever is left in the netns), deletes the veths, the namespaces
and the bridge, even after an exception. Processes started from the main thread get SIGKILL
when their parent dies (``kvstore.proc.die_with_parent``); the namespaces and bridge of a
harness whose process was killed are swept by the next ``Hosts`` to start (their names carry
the pid).

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN), ``ip`` (iproute2), ``unshare`` and ``nsenter``
(util-linux). Failing to make the namespaces raises ``HostsError``.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.proc import die_with_parent, signal_group

__all__ = ["Hosts", "Host", "HostsError", "sweep_stale"]

_NETNS_RE = re.compile(r"^kvh-(\d+)-(\d+)-(\d+)$")
_BRIDGE_RE = re.compile(r"^kvb-(\d+)$")
_ETC_NETNS = Path("/etc/netns")
_live: set["Hosts"] = set()


class HostsError(RuntimeError):
    """The namespaces, veths or bridge could not be made (not root, no ``ip``, a kernel
    without network namespaces...): the message says which command failed and why."""


def _ip(*args: str, check: bool = True) -> str:
    try:
        r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HostsError(f"ip {' '.join(args)}: {e}") from None
    if check and r.returncode != 0:
        raise HostsError(f"ip {' '.join(args)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn: SIGKILL when the parent dies; from the main thread only (the kernel ties
    it to the forking thread, and another may end before the process)."""
    return die_with_parent(signal.SIGKILL) if threading.current_thread() is threading.main_thread() else None


def _netns_names() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _link_names() -> list[str]:
    names = []
    for line in _ip("-o", "link", "show").splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def _kill_netns(name: str) -> None:
    """SIGKILL every process left in netns ``name``."""
    for pid in _ip("netns", "pids", name, check=False).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def sweep_stale() -> None:
    """Remove the namespaces and bridges of harnesses whose process is dead (best effort)."""
    live_k: set[str] = set()
    for name in _netns_names():
        m = _NETNS_RE.match(name)
        if m is None:
            continue
        if _alive(int(m.group(1))):
            live_k.add(m.group(2))
            continue
        _kill_netns(name)
        _ip("link", "del", f"kvv-{m.group(2)}-{m.group(3)}", check=False)
        _ip("netns", "del", name, check=False)
        shutil.rmtree(_ETC_NETNS / name, ignore_errors=True)
    for link in _link_names():
        m = _BRIDGE_RE.match(link)
        if m is not None and m.group(1) not in live_k:  # bridges are made after their netns
            _ip("link", "del", link, check=False)


@dataclass(eq=False)
class Host:
    """One host: ``name`` (its netns and hostname), ``address`` (where other hosts and the
    root namespace reach it)."""

    name: str
    address: str
    veth: str
    _init: subprocess.Popen[bytes] | None = None
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    def command(self, argv: Sequence[str], cwd: str | os.PathLike[str] | None = None) -> list[str]:
        """``argv`` as a command line that runs it inside this host (``nsenter`` into its
        namespaces, working directory ``cwd``, default this process's). nsenter execs
        ``argv`` without forking, so the pid started is ``argv``'s own; who starts it
        (``ChildProcess``, ``popen``) keeps its process group, signals and restarts. Whatever
        runs in the host dies at teardown."""
        assert self._init is not None and self._init.poll() is None, f"host {self.name} is down"
        wd = os.fspath(cwd or os.getcwd())
        return ["nsenter", f"--target={self._init.pid}", "--mount", "--uts", "--net",
                f"--wd={wd}", "--", *argv]

    def popen(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this host (its netns, ``/dev/shm`` and hostname) in a process
        group of its own; ``cwd`` (default: this process's) is kept. Other keywords go to
        ``subprocess.Popen``. Teardown kills it."""
        cwd = os.fspath(kw.pop("cwd", None) or os.getcwd())
        proc = subprocess.Popen(
            self.command(argv, cwd),
            env=dict(os.environ if env is None else env), cwd=cwd, start_new_session=True,
            preexec_fn=_die_with_parent(), **kw)
        self._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout: float = 10.0,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside this host to completion; its output as text."""
        proc = self.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)

    def _start(self, shm_size: str) -> None:
        script = ('mount -t tmpfs -o "size=$1,mode=1777" tmpfs /dev/shm && hostname "$2" '
                  '&& echo ready && exec sleep infinity')
        init = self._init = subprocess.Popen(
            ["ip", "netns", "exec", self.name, "unshare", "--mount", "--uts", "--propagation",
             "private", "sh", "-c", script, "sh", shm_size, self.name],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=_die_with_parent())
        assert init.stdout is not None and init.stderr is not None
        if init.stdout.readline() != b"ready\n":  # the line, or EOF when a step failed
            init.wait()
            raise HostsError(f"cannot start host {self.name}: "
                             f"{init.stderr.read().decode(errors='replace').strip()}")
        init.stdout.close()
        init.stderr.close()

    def _stop(self, grace: float) -> None:
        procs = [p for p in self._procs if p.poll() is None]
        for p in procs:
            signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self._procs + ([self._init] if self._init else []):
            signal_group(p.pid, signal.SIGKILL)
        _kill_netns(self.name)  # what left its group (setsid, double fork)
        for p in self._procs + ([self._init] if self._init else []):
            p.wait()
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    f.close()


class Hosts:
    """``with Hosts(n) as hosts:`` N hosts (``hosts[i]``, a ``Host``) on a fresh bridge;
    ``bridge_address`` is the root namespace's address on it. ``shm_size`` caps each host's
    ``/dev/shm``. See the module docstring for the layout and the teardown."""

    def __init__(self, n: int, *, shm_size: str = "512M") -> None:
        if not 1 <= n <= 244:
            raise ValueError(f"n must be in [1, 244], got {n}")
        self.n = n
        self.shm_size = shm_size
        self.hosts: list[Host] = []
        self.bridge = ""
        self.bridge_address = ""
        self._netns: list[str] = []

    def __enter__(self) -> "Hosts":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def start(self) -> "Hosts":
        missing = [tool for tool in ("ip", "unshare", "nsenter") if shutil.which(tool) is None]
        if missing:
            raise HostsError(f"missing {', '.join(missing)} (iproute2, util-linux)")
        if os.geteuid() != 0:
            raise HostsError("not root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)")
        _live.add(self)
        sweep_stale()
        k = self._free_octet()
        self.bridge, self.bridge_address = f"kvb-{k}", f"10.77.{k}.1"
        for i in range(self.n):  # namespaces first: a bridge without one is stale (sweep_stale)
            name = f"kvh-{os.getpid()}-{k}-{i}"
            _ip("netns", "add", name)
            self._netns.append(name)
        _ip("link", "add", self.bridge, "type", "bridge", "forward_delay", "0")
        _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        etc_hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"10.77.{k}.{10 + i} {name}\n" for i, name in enumerate(self._netns))
        for name in self._netns:
            etc = _ETC_NETNS / name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(etc_hosts)
            (etc / "resolv.conf").write_text("# no nameserver: lookups stay inside (hosts.py)\n"
                                             "options timeout:1 attempts:1\n")
        for i, name in enumerate(self._netns):
            host = Host(name=name, address=f"10.77.{k}.{10 + i}", veth=f"kvv-{k}-{i}")
            self.hosts.append(host)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", host.veth, "master", self.bridge, "up")
            _ip("-n", name, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "route", "add", "default", "via", self.bridge_address)
            host._start(self.shm_size)
        return self

    def _free_octet(self) -> int:
        used = set(re.findall(r"\b10\.77\.(\d+)\.", _ip("-o", "-4", "addr", "show")))
        used |= {m.group(1) for m in map(_BRIDGE_RE.match, _link_names()) if m}
        used |= {m.group(2) for m in map(_NETNS_RE.match, _netns_names()) if m}
        for k in range(256):
            if str(k) not in used:
                return k
        raise HostsError("no free 10.77.k.0/24 subnet: 256 harnesses are running")

    def close(self, grace: float = 5.0) -> None:
        """Kill every process of every host, then delete veths, namespaces and the bridge.
        Idempotent; never raises for what is already gone."""
        for host in self.hosts:
            host._stop(grace)
        for host in self.hosts:
            _ip("link", "del", host.veth, check=False)
        for name in self._netns:
            _kill_netns(name)
            _ip("netns", "del", name, check=False)
            shutil.rmtree(_ETC_NETNS / name, ignore_errors=True)
        if self.bridge:
            _ip("link", "del", self.bridge, check=False)
        self.hosts, self._netns, self.bridge = [], [], ""
        _live.discard(self)


@atexit.register
def _close_live() -> None:
    for hosts in list(_live):
        hosts.close(grace=1.0)
