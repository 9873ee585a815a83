"""What idle connections cost a store daemon, and what they do to a busy client's latency.

Starts one ``kvstore serve`` (a subprocess), measures a good client's GET latency alone,
then opens ``--connections`` idle, authenticated connections from a second process and
measures again, with the daemon's threads and memory before and after. One JSON line::

    python -m benchmarks.store.store_conn_bench                  # 10,000 idle connections
    python -m benchmarks.store.store_conn_bench --connections 2000 --requests 1000

Seeded (the block contents); bounded in time (each phase has a deadline, well under two
minutes in all on a laptop). Its targets ("grows by at most 200 MB and 64
threads, p99 within 2x") are ``rss_growth_mb``, ``thread_growth`` and ``p99_ratio``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import socket
import sys
import time

from benchmarks.lifecycle import REPO
from benchmarks.report import emit, machine_info
from kvstore.daemon.local import start_local, stop_local
from kvstore.net import sockio


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":", 1) for line in f if ":" in line)


def _kb(pid: int, field: str) -> int:
    return int(_status(pid)[field].split()[0])


def _raise_nofile(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))


def _hold(port: int, n: int, ready, stop) -> None:
    """The second process: open ``n`` connections, say HELLO on each, then wait."""
    from kvstore.net import protocol as P

    _raise_nofile(n + 256)
    meta = P.pack_json({"token": None, "host_id": "bench", "pid": os.getpid()})
    hello = P.pack_header(P.Op.HELLO, 0, 1, len(meta)) + meta
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(hello)
            socks.append(s)
        for s in socks:
            hdr = bytearray(P.HEADER_SIZE)
            sockio.recv_exact(s, memoryview(hdr))
            h = P.unpack_header(hdr)
            sockio.recv_exact(s, memoryview(bytearray(h.meta_len)))
            if h.flags & P.FLAG_ERROR:
                raise RuntimeError("the daemon refused an idle connection")
        ready.put(len(socks))
    except BaseException as e:  # noqa: BLE001 - handed to the main thread, which reports it
        ready.put(repr(e))
    stop.wait(300)
    for s in socks:
        s.close()


def _latencies(client, keys, bufs, requests: int, deadline: float) -> list[float]:
    out = []
    for i in range(requests):
        if time.monotonic() > deadline:
            break
        k = keys[i % len(keys)]
        t0 = time.perf_counter()
        client.get([k], [bufs[0]])
        out.append(time.perf_counter() - t0)
    return sorted(out)


def _pct(xs: list[float], q: float) -> float:
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 4)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.store.store_conn_bench",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--connections", type=int, default=10_000,
                   help="idle connections opened from a second process (default 10000)")
    p.add_argument("--requests", type=int, default=3000,
                   help="GETs the good client times in each phase (default 3000)")
    p.add_argument("--block-size", type=int, default=64 << 10,
                   help="bytes of the block the good client gets (default 65536)")
    p.add_argument("--transport", choices=("tcp", "auto"), default="tcp",
                   help="the good client's path: tcp (through the daemon's serving threads) "
                        "or auto (shared memory on this host) (default tcp)")
    p.add_argument("--memory", default="256M", help="the daemon's --memory (default 256M)")
    p.add_argument("--seed", type=int, default=0, help="seed of the block contents (default 0)")
    p.add_argument("--phase-timeout", type=float, default=40.0, metavar="SECONDS",
                   help="deadline of each phase (default 40)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import numpy as np

    from kvstore import Client

    _raise_nofile(args.connections + 512)
    try:
        daemon, address = start_local(args.memory, extra=["--max-connections", str(args.connections + 100)],
                                      cwd=REPO)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    holder = None
    try:
        port = int(address.rsplit(":", 1)[1])
        pid = daemon.pid
        rng = np.random.default_rng(args.seed)
        keys = [rng.bytes(16) for _ in range(16)]
        with Client(address, transport=args.transport, timeout=30) as c:
            c.put(keys, [rng.integers(0, 255, args.block_size, dtype=np.uint8) for _ in keys])
            bufs = [np.empty(args.block_size, np.uint8)]
            _latencies(c, keys, bufs, 200, time.monotonic() + 10)  # warm up
            before = {"rss_kb": _kb(pid, "VmRSS"), "anon_kb": _kb(pid, "RssAnon"),
                      "threads": _kb(pid, "Threads")}
            alone = _latencies(c, keys, bufs, args.requests, time.monotonic() + args.phase_timeout)

            ready = ctx.Queue()
            holder = ctx.Process(target=_hold, args=(port, args.connections, ready, stop))
            t0 = time.monotonic()
            holder.start()
            got = ready.get(timeout=args.phase_timeout)
            if not isinstance(got, int):
                raise SystemExit(f"opening the idle connections failed: {got}")
            open_s = time.monotonic() - t0
            loaded = _latencies(c, keys, bufs, args.requests, time.monotonic() + args.phase_timeout)
            after = {"rss_kb": _kb(pid, "VmRSS"), "anon_kb": _kb(pid, "RssAnon"),
                     "threads": _kb(pid, "Threads")}
            served = c.stats()["server"]["connections"]
    finally:
        stop.set()
        if holder is not None:
            holder.join(30)
        stop_local(daemon, 30)
    result = {
        "bench": "store_conn_bench", "connections": args.connections, "open_s": round(open_s, 2),
        "daemon_connections": served, "transport": args.transport, "block_bytes": args.block_size,
        "requests": len(alone), "threads_before": before["threads"], "threads_after": after["threads"],
        "thread_growth": after["threads"] - before["threads"],
        "rss_mb_before": round(before["rss_kb"] / 1024, 1), "rss_mb_after": round(after["rss_kb"] / 1024, 1),
        "rss_growth_mb": round((after["rss_kb"] - before["rss_kb"]) / 1024, 1),
        "anon_growth_mb": round((after["anon_kb"] - before["anon_kb"]) / 1024, 1),
        "p50_ms_alone": _pct(alone, 0.5), "p99_ms_alone": _pct(alone, 0.99),
        "p50_ms_loaded": _pct(loaded, 0.5), "p99_ms_loaded": _pct(loaded, 0.99),
        "p99_ratio": round(_pct(loaded, 0.99) / max(_pct(alone, 0.99), 1e-9), 2),
        "machine": machine_info(),
    }
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
