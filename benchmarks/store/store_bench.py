"""Store benchmark: put/get throughput of one real daemon over shared memory and TCP.

One command, seeded, one JSON line on stdout, a PNG plot in ``--out``::

    .venv/bin/python -m benchmarks.store.store_bench --out benchmarks/results [--quick] [--peer mooncake]

For each block size (4 KiB, 64 KiB, 360 KiB, 720 KiB, 1 MiB, 16 MiB) and batch (1, 64) it times
``Client.put`` and ``Client.get`` (into preallocated NumPy buffers) over the shared-memory
path (``transport="auto"`` on the same host) and the TCP path (``transport="tcp"``), against
a daemon started as a subprocess. In the same run it measures the two ceilings:

- memcpy: ``np.copyto`` of the same batch from one pre-touched shared-memory region (the
  same kind of memory as the daemon's arena) into the same destination buffers the gets
  fill. ``memcpy_private`` copies from a private NumPy array instead, reported alongside:
  where the kernel backs large private arrays with transparent huge pages but not shared
  memory (``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` = never), that copy is
  up to ~2.5x faster than any copy out of shared memory can be, so it is not the ceiling
  of the shared-memory path;
- raw socket: loopback TCP from another process that ``sendmsg``s the whole batch as one
  iovec from preallocated buffers, received here with ``recvmsg_into`` straight into the same
  destination buffers, both sockets set up exactly as the client's (``tune_socket``: same
  socket buffer sizes, same chunking). It is what the TCP path would be with a free protocol.

Ratios: shm get / memcpy, TCP get / raw socket. Targets: batched gets of blocks >= 360 KiB
reach >= 60% of each ceiling. The four are timed interleaved (one repetition of each in
turn), so a burst of load from elsewhere hits them alike; each figure is the best of
``--iters`` repetitions after one warm-up. A batch is capped at ``--max-batch-bytes`` (fewer
blocks of 16 MiB); the JSON records the batch actually used.

Latency of batch-1 gets: ``--lat-iters`` single-block gets of each size (shm and TCP in
alternating runs of a tenth each, after a warm-up), reported as ``*_get_p50_us`` /
``*_get_p99_us``; with ``--peer mooncake`` the same count of Mooncake's one-key ``get_into``
(and one-key ``batch_get_into``, ``mooncake_batch_get_p50_us`` ...); blocks over 1 MiB take
1/50 of the count. Targets: one 4 KiB get
over shared memory at p50 <= 30 us and p99 <= 100 us; batch-1 360 KiB and 720 KiB gets ahead
of Mooncake (throughput, best round, and p50) over both paths.

``--peer mooncake`` also runs Mooncake Store on the same cases in the same run: a driver
(``benchmarks/peers/mooncake_driver.py``) runs in Mooncake's own virtual environment
(``--mooncake-python``; ``benchmarks/peers/setup_mooncake.sh`` creates it), starts
``mooncake_master`` with its HTTP metadata server on loopback, a storage process holding the
memory and a client over protocol ``tcp``, and answers each case as JSON. This process never
imports Mooncake. Target: both our paths beat it on every batched size from 360 KiB up.

``--hosts 2`` instead runs the daemon on one host and the client on another of the multi-host
harness (``router.cluster.hosts``; needs root), gets and puts over the veth link against a raw
socket over the same link, plus a 2k-token prompt's handoff (``benchmarks/store/store_hosts.py``).
Target: batched gets of blocks >= 360 KiB reach >= 80% of the raw socket. No plot. With
``--tls`` the daemon and client speak TLS, against the plain raw socket and a TLS one. With
``--transport ucx`` the daemon serves UCX and the client moves the blocks over it, against our
TCP path and the raw socket on the same link, with the serving process's CPU-seconds per GB
beside each (``store_hosts``' docstring). Without ``--hosts``, ``--transport ucx`` adds a UCX
client on this host (UCX over loopback) to every case: ``ucx_get_gbps``, ``ucx_put_gbps`` and
their ratios to our TCP path and the raw socket.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks import lifecycle
from benchmarks.lifecycle import REPO
from benchmarks.report import emit, machine_info, pyplot, save_figure
from kvstore import Client
from kvstore.daemon.local import start_local
from kvstore.keys import BlockKey
from kvstore.net.sockio import recv_buffers, send_buffers, tune_socket

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, 360 * KiB, 720 * KiB, 1 * MiB, 16 * MiB]
BATCHES = [1, 64]
MOONCAKE_DRIVER = REPO / "benchmarks" / "peers" / "mooncake_driver.py"
MOONCAKE_PYTHON_DEFAULT = Path.home() / ".cache" / "kvcache-store" / "mooncake-venv" / "bin" / "python"


def start_daemon(memory: str, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    try:
        return start_local(memory, extra=extra, popen=lifecycle.popen, cwd=REPO)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


def _raw_sender(port: int, max_bytes: int) -> None:
    """Serve 'send me COUNT x SIZE bytes' from one preallocated region, the whole batch in
    one ``sendmsg`` iovec as the daemon sends a GET's blocks (the socket ceiling)."""
    src = np.random.default_rng(1).integers(0, 256, max_bytes, dtype=np.uint8)
    with socket.create_connection(("127.0.0.1", port)) as s:
        tune_socket(s, None)
        hdr = memoryview(bytearray(16))
        while True:
            try:
                recv_buffers(s, [hdr])
            except ConnectionError:
                return
            size, count = np.frombuffer(hdr, "<u8").tolist()
            send_buffers(s, [src[i * size: (i + 1) * size] for i in range(count)])


class RawSocket:
    """Loopback TCP from another process: the ceiling of the TCP path."""

    def __init__(self, max_bytes: int) -> None:
        lsock = socket.socket()
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(1)
        self.proc = mp.get_context("spawn").Process(
            target=_raw_sender, args=(lsock.getsockname()[1], max_bytes), daemon=True)
        self.proc.start()
        self.sock, _ = lsock.accept()
        tune_socket(self.sock, None)
        lsock.close()

    def get(self, bufs: list[np.ndarray]) -> None:
        self.sock.sendall(np.array([bufs[0].nbytes, len(bufs)], "<u8").tobytes())
        recv_buffers(self.sock, bufs)

    def close(self) -> None:
        self.sock.close()
        self.proc.join(5)


class Mooncake:
    """Mooncake Store through its driver subprocess (see the module docstring)."""

    def __init__(self, python: Path, memory: int, log_dir: Path) -> None:
        if not python.exists():
            raise SystemExit(
                f"--peer mooncake: no Python at {python}. Create Mooncake's environment with "
                "`bash benchmarks/peers/setup_mooncake.sh` (a venv with "
                "mooncake-transfer-engine-non-cuda, plus Debian's libibverbs1), or pass "
                "--mooncake-python PATH")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.proc = lifecycle.popen(
            [str(python), str(MOONCAKE_DRIVER), "serve", "--memory", str(memory),
             "--log-dir", str(log_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(log_dir / "mooncake_driver.log", "w"), text=True,
            env=dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1"))
        hello = self._read()
        if not hello.get("ready"):
            self.close()
            raise SystemExit(f"--peer mooncake: Mooncake Store did not start: "
                             f"{hello.get('error', hello)} (logs in {log_dir})")
        self.version = hello.get("version")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            return {"error": f"the driver exited with code {self.proc.wait()}"}
        return json.loads(line)

    def case(self, block_bytes: int, batch: int, iters: int, seed: int) -> dict:
        self.proc.stdin.write(json.dumps({"op": "case", "block_bytes": block_bytes,
                                          "batch": batch, "iters": iters, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        res = self._read()
        if "error" in res:
            raise SystemExit(f"--peer mooncake: {block_bytes} B x {batch} failed: {res['error']}")
        return res

    def latency(self, block_bytes: int, n: int, seed: int) -> dict:
        """p50/p99 (us) of ``n`` one-key ``get_into`` and ``batch_get_into`` calls."""
        self.proc.stdin.write(json.dumps({"op": "latency", "block_bytes": block_bytes, "n": n,
                                          "seed": seed}) + "\n")
        self.proc.stdin.flush()
        res = self._read()
        if "error" in res:
            raise SystemExit(f"--peer mooncake: latency of {block_bytes} B failed: {res['error']}")
        return res

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def best_of(fns: dict, iters: int) -> dict[str, float]:
    """Time each of ``fns`` once per round, ``iters`` rounds after one warm-up round; the
    best (minimum) seconds of each: on a shared machine the least disturbed run."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in times.items()}


def latencies(fns: dict, n: int, blocks: int = 10) -> dict[str, tuple[float, float]]:
    """p50 and p99 (microseconds) of ``n`` calls of each of ``fns`` after a warm-up of
    ``n // 10 + 1`` calls each, in ``blocks`` runs per function taken in turn: load from
    elsewhere lands on all alike, but a call never follows one of another path (a TCP get's
    daemon work would overlap the next shared-memory get on this machine's 2 CPUs)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(n // 10 + 1):
            fn()
    per = max(1, n // blocks)
    while any(len(v) < n for v in times.values()):
        for name, fn in fns.items():
            got = times[name]
            for _ in range(min(per, n - len(got))):
                t0 = time.perf_counter()
                fn()
                got.append(time.perf_counter() - t0)
    return {k: (float(np.percentile(v, 50)) * 1e6, float(np.percentile(v, 99)) * 1e6)
            for k, v in times.items()}


def run_case(size: int, batch: int, iters: int, rng, shm: Client, tcp: Client, raw: RawSocket,
             mooncake: Mooncake | None, seed: int, lat_iters: int = 0,
             ucx: Client | None = None) -> dict:
    nbytes = size * batch
    private = rng.integers(0, 256, nbytes, dtype=np.uint8)
    shared = np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED), np.uint8)
    np.copyto(shared, private)  # one pre-touched shared-memory region, like the arena
    src = [shared[i * size: (i + 1) * size] for i in range(batch)]
    src_private = [private[i * size: (i + 1) * size] for i in range(batch)]
    dst = [np.ones(size, np.uint8) for _ in range(batch)]  # pre-touched pages
    row: dict = {"block_bytes": size, "batch": batch}
    clients = {"shm": shm, "tcp": tcp, **({"ucx": ucx} if ucx is not None else {})}
    keys = {name: [BlockKey(rng.bytes(16)) for _ in range(batch)] for name in clients}
    for name, client in clients.items():
        put_times = []
        for _ in range(iters + 1):
            client.delete(keys[name])
            t0 = time.perf_counter()
            client.put(keys[name], src)
            put_times.append(time.perf_counter() - t0)
        row[f"{name}_put_gbps"] = nbytes / min(put_times[1:]) / 1e9
        found = client.get(keys[name], dst)
        assert all(found) and np.array_equal(dst[-1], src[-1]), "wrong bytes read back"
    best = best_of({
        "memcpy": lambda: [np.copyto(d, s) for d, s in zip(dst, src)],
        "memcpy_private": lambda: [np.copyto(d, s) for d, s in zip(dst, src_private)],
        "shm_get": lambda: shm.get(keys["shm"], dst),
        "raw_socket": lambda: raw.get(dst),
        "tcp_get": lambda: tcp.get(keys["tcp"], dst),
        **({"ucx_get": lambda: ucx.get(keys["ucx"], dst)} if ucx is not None else {}),
    }, iters)
    if batch == 1 and lat_iters:
        lat_iters = lat_iters if size <= MiB else max(20, lat_iters // 50)  # 16 MiB: ms each
        lat = latencies({"shm_get": lambda: shm.get(keys["shm"], dst),
                         "tcp_get": lambda: tcp.get(keys["tcp"], dst)}, lat_iters)
        for name, (p50, p99) in lat.items():
            row[f"{name}_p50_us"], row[f"{name}_p99_us"] = p50, p99
    for name, client in clients.items():
        client.delete(keys[name])
    for name, s in best.items():
        row[f"{name}_gbps"] = nbytes / s / 1e9
    row["shm_get_vs_memcpy"] = row["shm_get_gbps"] / row["memcpy_gbps"]
    row["tcp_get_vs_raw_socket"] = row["tcp_get_gbps"] / row["raw_socket_gbps"]
    if ucx is not None:  # --transport ucx: UCX (over loopback here) against our TCP path
        row["ucx_get_vs_tcp"] = row["ucx_get_gbps"] / row["tcp_get_gbps"]
        row["ucx_put_vs_tcp"] = row["ucx_put_gbps"] / row["tcp_put_gbps"]
        row["ucx_get_vs_raw_socket"] = row["ucx_get_gbps"] / row["raw_socket_gbps"]
    if mooncake is not None:
        mc = mooncake.case(size, batch, iters, seed)
        row["mooncake_put_gbps"], row["mooncake_get_gbps"] = mc["put_gbps"], mc["get_gbps"]
        peer = mc["get_gbps"]
        if "get_into_gbps" in mc:  # batch 1: Mooncake's faster one-key call
            row["mooncake_get_into_gbps"] = mc["get_into_gbps"]
            peer = max(peer, mc["get_into_gbps"])
        row["shm_get_vs_mooncake"] = row["shm_get_gbps"] / peer
        row["tcp_get_vs_mooncake"] = row["tcp_get_gbps"] / peer
        if batch == 1 and lat_iters:
            ml = mooncake.latency(size, lat_iters, seed)
            row["mooncake_get_p50_us"], row["mooncake_get_p99_us"] = ml["get_into_us"]
            row["mooncake_batch_get_p50_us"], row["mooncake_batch_get_p99_us"] = ml["batch_get_into_us"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.store.store_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"),
                    help="directory for store_bench.png (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="fewer iterations, smaller batches (< 1 min)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the block contents and keys")
    ap.add_argument("--iters", type=int, default=None,
                    help="timed iterations per case, best taken (default 15; --quick 5)")
    ap.add_argument("--lat-iters", type=int, default=None,
                    help="single-block gets timed per size for p50/p99 (default 5000; --quick 500)")
    ap.add_argument("--memory", default="2G", help="daemon arena size (and Mooncake's pool)")
    ap.add_argument("--max-batch-bytes", default=None,
                    help="cap on one batch in bytes (default 512 MiB; --quick 64 MiB)")
    ap.add_argument("--peer", choices=("mooncake",), action="append", default=[],
                    help="also run this peer store on the same cases")
    ap.add_argument("--mooncake-python", default=os.environ.get("KVSTORE_MOONCAKE_PYTHON",
                                                                str(MOONCAKE_PYTHON_DEFAULT)),
                    help="Python of Mooncake's own venv (default %(default)s)")
    ap.add_argument("--hosts", type=int, choices=(2,), default=None,
                    help="2: the daemon on one host and the client on another (network "
                         "namespaces over a veth link; root), against a raw socket on that link")
    ap.add_argument("--tls", action="store_true",
                    help="with --hosts: the daemon and client speak TLS (the raw socket stays "
                         "plain), so the ratio is TLS's cost on the link")
    ap.add_argument("--transport", choices=("tcp", "ucx"), default="tcp",
                    help="ucx: the daemon serves UCX and a UCX client is timed beside our TCP "
                         "path and the raw socket (on one host over loopback; with --hosts 2 "
                         "as the client across the link); default tcp")
    ap.add_argument("--no-handoff", action="store_true",
                    help="with --hosts: skip the 2k-token prompt's KV handoff")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    iters = args.iters or (5 if args.quick else 15)
    lat_iters = args.lat_iters if args.lat_iters is not None else (500 if args.quick else 5000)
    cap = int(args.max_batch_bytes or (64 * MiB if args.quick else 512 * MiB))
    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from kvstore.daemon.config import parse_size

    if args.hosts:
        return _main_hosts(args, iters, cap)
    if args.tls or args.no_handoff:
        raise SystemExit("--tls and --no-handoff go with --hosts 2")
    mooncake = None
    if "mooncake" in args.peer:
        mooncake = Mooncake(Path(args.mooncake_python), parse_size(args.memory), out / "mooncake-logs")
    proc, address = start_daemon(args.memory, ("--ucx",) if args.transport == "ucx" else ())
    cases = [(s, max(1, min(b, cap // s))) for s in SIZES for b in BATCHES]
    raw = RawSocket(max(s * b for s, b in cases))
    rows = []
    try:
        shm = Client(address)
        tcp = Client(address, transport="tcp")
        ucx = Client(address, transport="ucx") if args.transport == "ucx" else None
        assert shm.transport == "shm", "the benchmark must run on the daemon's host"
        for size, batch in tqdm(cases, desc="store_bench", file=sys.stderr):
            rows.append(run_case(size, batch, iters, rng, shm, tcp, raw, mooncake, args.seed,
                                 lat_iters, ucx))
        shm.close()
        tcp.close()
        if ucx is not None:
            ucx.close()
    finally:
        raw.close()
        proc.terminate()
        proc.wait(15)
        if mooncake is not None:
            mooncake.close()

    batched = [r for r in rows if r["batch"] > 1 and r["block_bytes"] >= 360 * KiB]
    targets = {
        "shm_get_ge_60pct_memcpy": all(r["shm_get_vs_memcpy"] >= 0.6 for r in batched),
        "tcp_get_ge_60pct_raw_socket": all(r["tcp_get_vs_raw_socket"] >= 0.6 for r in batched),
    }
    small = [r for r in rows if r["batch"] == 1 and r["block_bytes"] == 4 * KiB and "shm_get_p50_us" in r]
    if small:
        targets["shm_4k_get_p50_le_30us_p99_le_100us"] = all(
            r["shm_get_p50_us"] <= 30 and r["shm_get_p99_us"] <= 100 for r in small)
    if mooncake is not None:
        targets["shm_and_tcp_get_beat_mooncake"] = all(
            min(r["shm_get_vs_mooncake"], r["tcp_get_vs_mooncake"]) > 1 for r in batched)
        single = [r for r in rows if r["batch"] == 1 and r["block_bytes"] in (360 * KiB, 720 * KiB)]
        targets["single_360k_720k_get_beat_mooncake"] = all(
            min(r["shm_get_vs_mooncake"], r["tcp_get_vs_mooncake"]) > 1
            and ("mooncake_get_p50_us" not in r
                 or max(r["shm_get_p50_us"], r["tcp_get_p50_us"]) < r["mooncake_get_p50_us"])
            for r in single)
    plot = out / "store_bench.png"
    _plot(rows, plot)
    emit({
        "bench": "store", "seed": args.seed, "quick": args.quick, "iters": iters,
        "lat_iters": lat_iters,
        "peers": {"mooncake": mooncake.version} if mooncake is not None else {},
        "machine": machine_info(),
        "targets_met": targets, "plot": str(plot), "results": rows,
    })


def _main_hosts(args: argparse.Namespace, iters: int, cap: int) -> None:
    from benchmarks.store import store_hosts

    if args.peer:
        raise SystemExit("--peer does not go with --hosts")
    res = store_hosts.run(SIZES, BATCHES, iters=iters, cap=cap, memory=args.memory,
                          seed=args.seed, handoff=not args.no_handoff, tls=args.tls,
                          transport=args.transport)
    rows = res["results"]
    batched = [r for r in rows if r["batch"] > 1 and r["block_bytes"] >= 360 * KiB]

    def label(r: dict) -> str:
        b = r["block_bytes"]
        return f"{b // MiB} MiB x {r['batch']}" if b % MiB == 0 else f"{b // KiB} KiB x {r['batch']}"

    emit({
        "bench": "store_hosts", "hosts": args.hosts, "tls": args.tls, "transport": args.transport,
        "seed": args.seed,
        "quick": args.quick, "iters": iters, "max_batch_bytes": cap, "memory": args.memory,
        "machine": machine_info(),
        "link": res["link"],
        "targets_met": {"get_ge_80pct_raw_socket": all(r["get_vs_raw"] >= 0.8 for r in batched)},
        "ratios": {label(r): {"get": r["get_vs_raw"], "put": r["put_vs_raw"],
                              **({"get_vs_tcp": r["get_vs_tcp"], "put_vs_tcp": r["put_vs_tcp"]}
                                 if "get_vs_tcp" in r else {}),
                              **({"get_vs_nixl": r["get_vs_nixl"], "put_vs_nixl": r["put_vs_nixl"]}
                                 if "get_vs_nixl" in r else {})} for r in rows},
        "handoff": res["handoff"], "results": rows,
    })


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    series = [s for s in ("memcpy_gbps", "shm_get_gbps", "raw_socket_gbps", "tcp_get_gbps",
                          "mooncake_get_gbps") if s in rows[0]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, batched in zip(axes, (False, True)):
        sel = [r for r in rows if (r["batch"] > 1) == batched]
        x = np.arange(len(sel))
        w = 0.8 / len(series)
        for i, name in enumerate(series):
            ax.bar(x + i * w, [r[name] for r in sel], w, label=name.replace("_gbps", ""))
        ax.set_xticks(x + 0.4 - w / 2, [f"{r['block_bytes'] // KiB} KiB\nx{r['batch']}" for r in sel])
        ax.set_title("batched gets (up to 64 blocks)" if batched else "single-block gets")
        ax.set_ylabel("GB/s")
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"kvstore store_bench: get throughput ({os.cpu_count()} CPUs, {platform.machine()})")
    fig.tight_layout()
    save_figure(fig, path, dpi=72)


if __name__ == "__main__":
    sys.exit(lifecycle.run_main(main))
