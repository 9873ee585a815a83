"""Mooncake Store driver for ``benchmarks/store/store_bench.py --peer mooncake``.

Runs in Mooncake's own virtual environment (``mooncake-transfer-engine-non-cuda``), never in
the project's: the project process only talks to it over stdin/stdout, one JSON object a
line. It imports nothing from this repository.

    python mooncake_driver.py serve --memory BYTES

starts ``mooncake_master`` (its HTTP metadata server and RPC on loopback), a storage process
(this script, ``--role storage``) that mounts ``--memory`` bytes as its global segment, and a
client (this process) that mounts nothing and moves data over protocol ``tcp`` into and out
of buffers registered with ``register_buffer`` (``batch_put_from`` / ``batch_get_into``,
Mooncake's zero-copy batch calls). It prints ``{"ready": true, "version": ...}`` and then
answers each request line::

    {"op": "case", "block_bytes": N, "batch": B, "iters": I, "seed": S}
      -> {"put_gbps": ..., "get_gbps": ..., "put_s": [...], "get_s": [...]}
         (batch 1 also "get_into_gbps": the best single ``get_into``, Mooncake's one-key call)
    {"op": "latency", "block_bytes": N, "n": COUNT, "seed": S}
      -> {"get_into_us": [p50, p99], "batch_get_into_us": [p50, p99]}
    {"op": "quit"}

An error is answered ``{"error": "..."}``. Timing is the same as store_bench's: each put
(after removing the keys) and each get is timed alone; the caller picks the statistic.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s")


def _setup(store, cfg: dict, segment: int, local_buffer: int) -> None:
    rc = store.setup("127.0.0.1", cfg["metadata"], segment, local_buffer, "tcp", "",
                     cfg["master"])
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")


def storage(cfg: dict, memory: int) -> None:
    """Hold ``memory`` bytes of Mooncake's pool until stdin closes."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    _setup(store, cfg, memory, 16 << 20)
    print(json.dumps({"storage_ready": True}), flush=True)
    sys.stdin.read()
    store.close()


class Driver:
    def __init__(self, memory: int, log_dir: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        master_bin = shutil.which("mooncake_master") or str(Path(sys.executable).with_name("mooncake_master"))
        meta_port, rpc_port, metrics_port = _free_port(), _free_port(), _free_port()
        self.cfg = {"metadata": f"http://127.0.0.1:{meta_port}/metadata",
                    "master": f"127.0.0.1:{rpc_port}"}
        log = open(log_dir / "mooncake_master.log", "w")
        master = subprocess.Popen(
            [master_bin, "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={meta_port}",
             "--rpc_address=127.0.0.1", f"--rpc_port={rpc_port}", f"--metrics_port={metrics_port}",
             "--enable_metric_reporting=false"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(master)
        _wait_port(rpc_port, master, "mooncake_master")
        _wait_port(meta_port, master, "mooncake_master's HTTP metadata server")
        st = subprocess.Popen([sys.executable, __file__, "storage", "--memory", str(memory),
                               "--config", json.dumps(self.cfg)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=open(log_dir / "mooncake_storage.log", "w"), env=env, text=True)
        self.procs.append(st)
        line = st.stdout.readline()
        if "storage_ready" not in line:
            raise RuntimeError(f"Mooncake storage process failed to start: {line!r} "
                               f"(see {log_dir / 'mooncake_storage.log'})")
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        _setup(self.store, self.cfg, 0, 16 << 20)  # a pure client: it holds no pool memory
        self.registered: list = []

    def case(self, block_bytes: int, batch: int, iters: int, seed: int) -> dict:
        import numpy as np

        rng = np.random.default_rng(seed)
        src = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(batch)]
        dst = [np.ones(block_bytes, np.uint8) for _ in range(batch)]
        for a in src + dst:
            if self.store.register_buffer(a.ctypes.data, a.nbytes) != 0:
                raise RuntimeError("register_buffer failed")
        keys = [rng.bytes(16).hex() for _ in range(batch)]
        ptrs_src = [a.ctypes.data for a in src]
        ptrs_dst = [a.ctypes.data for a in dst]
        sizes = [block_bytes] * batch
        put_s, get_s = [], []
        try:
            for _ in range(iters + 1):
                self.store.batch_remove(keys, True)
                t0 = time.perf_counter()
                rcs = self.store.batch_put_from(keys, ptrs_src, sizes)
                put_s.append(time.perf_counter() - t0)
                if any(rc != 0 for rc in rcs):
                    raise RuntimeError(f"batch_put_from returned {sorted(set(rcs))}")
            for _ in range(iters + 1):
                t0 = time.perf_counter()
                got = self.store.batch_get_into(keys, ptrs_dst, sizes)
                get_s.append(time.perf_counter() - t0)
                if any(n != block_bytes for n in got):
                    raise RuntimeError(f"batch_get_into returned {sorted(set(got))}")
            if not np.array_equal(dst[-1], src[-1]):
                raise RuntimeError("Mooncake returned wrong bytes")
            self.store.batch_remove(keys, True)
        finally:
            for a in src + dst:
                self.store.unregister_buffer(a.ctypes.data)
        nbytes = block_bytes * batch
        out = {"put_gbps": nbytes / min(put_s[1:]) / 1e9, "get_gbps": nbytes / min(get_s[1:]) / 1e9,
               "put_s": put_s[1:], "get_s": get_s[1:]}
        if batch == 1:
            out["get_into_gbps"] = nbytes / min(self._single_gets(block_bytes, iters, rng)) / 1e9
        return out

    def _single_gets(self, block_bytes: int, n: int, rng) -> list[float]:
        """Seconds of each of ``n`` one-key ``get_into`` calls (after one warm-up)."""
        return self.latency(block_bytes, n, rng, raw=True)["get_into_s"]

    def latency(self, block_bytes: int, n: int, rng, raw: bool = False) -> dict:
        """``n`` one-key gets each of ``get_into`` and ``batch_get_into`` (one key),
        interleaved, after a warm-up: p50 and p99 in microseconds."""
        import numpy as np

        src = rng.integers(0, 256, block_bytes, dtype=np.uint8)
        dst = np.ones(block_bytes, np.uint8)
        for a in (src, dst):
            if self.store.register_buffer(a.ctypes.data, a.nbytes) != 0:
                raise RuntimeError("register_buffer failed")
        key = rng.bytes(16).hex()
        single, batched = [], []
        try:
            self.store.batch_remove([key], True)
            rcs = self.store.batch_put_from([key], [src.ctypes.data], [block_bytes])
            if any(rc != 0 for rc in rcs):
                raise RuntimeError(f"batch_put_from returned {sorted(set(rcs))}")
            ptr = dst.ctypes.data
            for i in range(n + 1):
                t0 = time.perf_counter()
                got = self.store.get_into(key, ptr, block_bytes)
                t1 = time.perf_counter()
                (got2,) = self.store.batch_get_into([key], [ptr], [block_bytes])
                t2 = time.perf_counter()
                if got != block_bytes or got2 != block_bytes:
                    raise RuntimeError(f"get_into returned {got}, batch_get_into {got2}")
                if i:
                    single.append(t1 - t0)
                    batched.append(t2 - t1)
            if not np.array_equal(dst, src):
                raise RuntimeError("Mooncake returned wrong bytes")
            self.store.batch_remove([key], True)
        finally:
            for a in (src, dst):
                self.store.unregister_buffer(a.ctypes.data)
        if raw:
            return {"get_into_s": single}

        def pct(xs: list[float]) -> list[float]:
            return [float(np.percentile(xs, q)) * 1e6 for q in (50, 99)]

        return {"get_into_us": pct(single), "batch_get_into_us": pct(batched)}

    def close(self) -> None:
        try:
            self.store.close()
        except Exception:  # noqa: BLE001 - closing Mooncake's store at exit: nothing to report
            pass
        for p in reversed(self.procs):
            if p.stdin:
                p.stdin.close()
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def serve(memory: int, log_dir: Path) -> None:
    import importlib.metadata as md

    out = sys.stdout
    sys.stdout = sys.stderr  # Mooncake's own prints must not interleave with the JSON lines
    try:
        driver = Driver(memory, log_dir)
    except Exception as e:  # noqa: BLE001 - reported to the bench as a JSON error
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), file=out, flush=True)
        return
    try:
        version = md.version("mooncake-transfer-engine-non-cuda")
    except md.PackageNotFoundError:
        version = "unknown"
    print(json.dumps({"ready": True, "version": version}), file=out, flush=True)
    try:
        for line in sys.stdin:
            req = json.loads(line)
            if req.get("op") == "quit":
                break
            try:
                if req.get("op") == "latency":
                    import numpy as np

                    res = driver.latency(req["block_bytes"], req["n"],
                                         np.random.default_rng(req.get("seed", 0)))
                else:
                    res = driver.case(req["block_bytes"], req["batch"], req["iters"], req.get("seed", 0))
            except Exception as e:  # noqa: BLE001 - reported to the bench as a JSON error
                res = {"error": f"{type(e).__name__}: {e}"}
            print(json.dumps(res), file=out, flush=True)
    finally:
        driver.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("role", choices=("serve", "storage"))
    ap.add_argument("--memory", type=int, default=2 << 30)
    ap.add_argument("--config", help="(storage) JSON of the master and metadata addresses")
    ap.add_argument("--log-dir", default="/tmp")
    args = ap.parse_args()
    if args.role == "storage":
        storage(json.loads(args.config), args.memory)
    else:
        serve(args.memory, Path(args.log_dir))


if __name__ == "__main__":
    main()
