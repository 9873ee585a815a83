"""The ``ucx_cuda`` section: UCX's CUDA transports between two processes on one GPU.

A child process (``python -m gpucheck.ucx_cuda``) holds ``BLOCKS`` blocks of the
default model's KV block size (``ipc.block_bytes()``: SmolLM2-135M, 16 tokens, bfloat16) with
the seeded contents of ``ipc.blocks()`` in CUDA tensors and sends each as one ucxx tagged
message into a CUDA tensor of this process: the first batch is checked bit-exact against the
seeded bytes, then the whole batch is timed (median of ``REPEATS``) against a device-to-device
copy of the same bytes within this process (GB/s of each and the ratio of their times; a
batch's time runs from the "send" line to the child until its last receive completed, the
receives posted before). The child runs with ``UCX_PROTO_INFO=y``: the protocol lines UCX
prints for its sends are kept, and the transports they name by the memory sent from
(``ucx_transports``, e.g. ``{"cuda": ["cuda_copy", "cuda_ipc"]}``), in the section's details.

Tagged messages through ucxx's core API (``ucxx._lib.libucxx``), not its async endpoints:
that is how the store's UCX data path moves blocks (``kvstore.net.ucx``: one tagged message a
block, a worker progressed by UCX's own thread, receives posted before the peer sends), so the
figure is the store's path on CUDA memory, without an event loop in either process. Unlike
``kvstore.net.ucx``'s worker, the progress thread makes device 0's CUDA context current as it
starts (as ucxx's own thread mode does), which UCX's CUDA transports need.

Control (the parent's worker address, "send <round>", "quit", and the child's answers) goes
over the child's stdin and stdout; every wait on it or on UCX is bounded by the section's cap.
The child is stopped however the section ends (and by the run's cleanups, should the watchdog
end it).

``ucxx`` is not in the device image and its CUDA 13 closure (~51 MiB) does not fit beside the
check's other wheels, so this section has a device run of its own: ``bash
scripts/gpu_wheels.sh --ucx`` where there is network, then, carrying ``.gpu_wheels_ucx``,
``GPU_WHEELS_DIR=.gpu_wheels_ucx bash scripts/gpu_check.sh --sections env ucx_cuda``. Without
ucxx the section is ``Unsupported``, saying so. Under ``--cpu-selftest`` the same protocol runs
on host buffers (numpy views of CPU tensors) with ``SELFTEST_BLOCKS`` blocks, the "d2d" figure
a host copy. The receiving UCX context lives in the driver's process until the section ends.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import re
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from gpucheck.ipc import block_bytes, blocks
from gpucheck.runner import Ctx, OutOfTime, Unsupported
from gpucheck.store import REPO

__all__ = ["run", "BLOCKS", "SELFTEST_BLOCKS", "REPEATS"]

BLOCKS = 124
SELFTEST_BLOCKS = 8
REPEATS = 5
ROUND_TIMEOUT_S = 30.0  # one batch's longest wait, within the cap
STOP_TIMEOUT_S = 10.0  # the child's exit after "quit"
SAY = "@@ "  # the child's control lines; anything else on its stdout is UCX's (UCX_PROTO_INFO)
NO_UCXX = ("ucxx is not importable ({}): the device image has no ucxx; run `bash "
           "scripts/gpu_wheels.sh --ucx` where there is network, carry .gpu_wheels_ucx, and run "
           "GPU_WHEELS_DIR=.gpu_wheels_ucx bash scripts/gpu_check.sh --sections env ucx_cuda")


def _ucxx() -> tuple[Any, Any]:
    """ucxx's core module and its ``Array``, or ``Unsupported`` saying how to get them."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        libucxx = importlib.import_module("ucxx._lib.libucxx")
        array = importlib.import_module("ucxx._lib.arr").Array
    except Exception as e:  # noqa: BLE001 - ImportError, or a library that does not load
        raise Unsupported(NO_UCXX.format(f"{type(e).__name__}: {e}")) from None
    return libucxx, array


def _tag(rnd: int, i: int) -> int:
    return (rnd << 32) | i


def _cuda_context() -> None:
    """Make device 0's primary context current on UCX's progress thread."""
    try:
        from ucxx._cuda_context import ensure_cuda_context  # type: ignore[import-not-found]

        ensure_cuda_context(0)
    except ImportError:  # no cuda-core: the runtime's cudaSetDevice makes it current too
        import torch

        torch.cuda.set_device(0)


def _worker(lib: Any, cuda: bool) -> tuple[Any, Any]:
    """A context and a worker progressed by UCX's thread (blocking mode), as kvstore.net.ucx's."""
    context = lib.UCXContext(feature_flags=(lib.Feature.TAG, lib.Feature.WAKEUP))
    worker = lib.UCXWorker(context)
    if cuda:
        worker.set_progress_thread_start_callback(_cuda_context)
    worker.start_progress_thread(polling_mode=False)
    return context, worker


def _buffers(tensors: list, cuda: bool) -> list:
    """What ucxx's ``Array`` takes: CUDA tensors as they are (``__cuda_array_interface__``),
    CPU tensors as numpy views of the same memory."""
    return list(tensors) if cuda else [t.numpy() for t in tensors]


def _transports(lines: list[str]) -> dict[str, list[str]]:
    """The transports UCX's protocol tables name, by the memory the sends came from: a table's
    head is ``| ucp_context_0 intra-node cfg#0 | tagged message by ucp_tag_send* from cuda/GPU0
    |``, its rows end in a cell such as ``| tcp/lo |`` or ``| 50% on cuda_ipc/cuda and 50% on
    rc_mlx5/mlx5_0:1 |``."""
    found: dict[str, set[str]] = {}
    memory = "unknown"
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "ucp_context" in line:
            m = re.search(r"\bfrom ([a-z][\w-]*)", line)
            memory = m.group(1) if m else "unknown"
        elif cells and cells[-1]:
            found.setdefault(memory, set()).update(re.findall(r"\b([a-z][a-z0-9_]*)/\S", cells[-1]))
    return {mem: sorted(ts) for mem, ts in found.items() if ts}


class _Child:
    """The sending process: its control lines on a queue, UCX's lines kept, stopped once."""

    def __init__(self, argv: list[str], err_path: Any) -> None:
        self.err_path = err_path
        self._err = open(err_path, "w")
        env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_WARN_UNUSED_ENV_VARS": "n"}
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     start_new_session=True)
        self.said: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.ucx_lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True, name="ucx-cuda-child")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(SAY):
                self.said.put(json.loads(line[len(SAY):]))
            elif line.strip():  # "[time] [host:pid:thread]  | ...": the part after the prefix
                self.ucx_lines.append(re.sub(r"^(\[[^]]*\]\s*){1,2}", "", line.rstrip()))
        self.said.put(None)  # its stdout closed: it exited

    def tell(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(f"the child exited ({self.proc.poll()}) before {cmd!r}: "
                               f"{self.stderr_tail()}") from None

    def stderr_tail(self) -> str:
        try:
            with open(self.err_path) as f:
                return f.read()[-2000:]
        except OSError:
            return ""

    def expect(self, key: str, deadline: float, ctx: Ctx) -> dict[str, Any]:
        """The child's next control message, which must hold ``key``."""
        try:
            msg = self.said.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            if ctx.left() <= 0:
                raise OutOfTime(f"the child did not answer ({key}) within the cap") from None
            raise RuntimeError(f"the child did not answer ({key}) in time: {self.stderr_tail()}") from None
        if msg is None:
            code = self.proc.wait(timeout=STOP_TIMEOUT_S)
            raise RuntimeError(f"the child exited ({code}) before {key}: {self.stderr_tail()}")
        if key not in msg:
            raise RuntimeError(f"the child answered {msg} (expected {key}): {self.stderr_tail()}")
        return msg

    def stop(self) -> int | None:
        """Ask it to quit, then kill it if it does not; its exit status (None: killed). Its
        stdout is read to the end (UCX's lines) once it exited."""
        code: int | None = None
        try:
            if self.proc.poll() is None:
                self.tell("quit")
            code = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except (OSError, ValueError, RuntimeError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._reader.join(timeout=STOP_TIMEOUT_S)
        self._err.close()
        return code


def run(ctx: Ctx, rec: dict[str, Any]) -> None:
    if not ctx.cuda and not ctx.selftest:
        raise Unsupported("no CUDA on this machine: UCX's CUDA transports move GPU memory")
    lib, Array = _ucxx()
    import torch
    import ucxx  # type: ignore[import-not-found]

    from kvstore.net.ucx import UcxError, wait

    n = SELFTEST_BLOCKS if ctx.selftest else BLOCKS
    size = block_bytes()
    total = n * size
    rec.update(blocks=n, block_bytes=size, total_mb=round(total / 1e6, 1),
               memory="cuda" if ctx.cuda else "host (--cpu-selftest)", ucxx=ucxx.__version__,
               ucx=".".join(map(str, lib.get_ucx_version())))
    _, want = blocks(n, size)
    device = "cuda" if ctx.cuda else "cpu"
    want_here = [v.to(device) for v in want]
    dst = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(n)]
    sync = torch.cuda.synchronize if ctx.cuda else (lambda: None)
    sync()  # also makes this process's CUDA context before UCX's
    arrays = [Array(b) for b in _buffers(dst, ctx.cuda)]

    context, worker = _worker(lib, ctx.cuda)
    child = _Child([sys.executable, "-m", "gpucheck.ucx_cuda",
                    worker.address.tobytes().hex(), str(n), str(size), device,
                    str(round(max(1.0, ctx.left()), 1))], ctx.work / "ucx_cuda_child.err")
    closed: list[Any] = []

    def close() -> None:
        """The child first (nothing sends any more), then cancel what is posted here and stop
        the progress thread; the receive buffers stay referenced until then."""
        if closed:
            return
        closed.append((context, worker))  # the context outlives the worker's progress thread
        rec["child_exit"] = child.stop()
        rec["ucx_proto_lines"] = [line for line in child.ucx_lines if "|" in line][:60]
        rec["ucx_transports"] = _transports(rec["ucx_proto_lines"])
        try:
            worker.cancel_inflight_requests()
        finally:
            worker.stop_progress_thread()

    ctx.cleanups.append(close)
    try:
        ready = child.expect("ready", min(ctx.deadline, time.monotonic() + 60.0), ctx)
        ctx.log(f"  child {child.proc.pid} ready ({ready['seconds']} s to start); "
                f"{n} blocks, {total / 1e6:.1f} MB, {rec['memory']} memory")

        def batch(rnd: int) -> float:
            """Post the receives, tell the child to send, wait for all of them: seconds."""
            reqs = [worker.tag_recv(a, lib.UCXXTag(_tag(rnd, i))) for i, a in enumerate(arrays)]
            deadline = min(ctx.deadline, time.monotonic() + ROUND_TIMEOUT_S)
            t0 = time.perf_counter()
            child.tell(f"send {rnd}")
            try:
                wait(reqs, deadline, abort=lambda: child.proc.poll() is not None)
            except UcxError as e:
                if ctx.left() <= 0:
                    raise OutOfTime(f"batch {rnd} did not arrive within the cap") from None
                raise RuntimeError(f"batch {rnd}: {e}; child: {child.stderr_tail()}") from None
            sync()
            seconds = time.perf_counter() - t0
            child.expect("sent", deadline, ctx)
            return seconds

        rec["first_batch_s"] = round(batch(0), 6)  # wires the endpoint up, maps the memory
        rec["bit_exact"] = all(torch.equal(d, w) for d, w in zip(dst, want_here))
        assert rec["bit_exact"], "a block received over UCX differs from the seeded bytes"
        times = []
        for rnd in range(1, REPEATS + 1):
            ctx.check_time(f"after {len(times)} timed batches")
            for d in dst:
                d.zero_()
            sync()
            times.append(batch(rnd))
        ucx_s = statistics.median(times)
        rec.update(ucx_s=round(ucx_s, 6), ucx_gbps=round(total / ucx_s / 1e9, 2))
        rec["bit_exact_after_timing"] = all(torch.equal(d, w) for d, w in zip(dst, want_here))
        assert rec["bit_exact_after_timing"], "a timed batch differs from the seeded bytes"
    finally:
        close()

    d2d = []
    for _ in range(REPEATS):
        sync()
        t0 = time.perf_counter()
        for d, w in zip(dst, want_here):
            d.copy_(w)
        sync()
        d2d.append(time.perf_counter() - t0)
    d2d_s = statistics.median(d2d)
    rec.update(d2d_s=round(d2d_s, 6), d2d_gbps=round(total / d2d_s / 1e9, 2),
               ucx_over_d2d=round(rec["ucx_s"] / d2d_s, 2))
    used = "; ".join(f"from {m}: {' '.join(t)}" for m, t in rec["ucx_transports"].items())
    ctx.log(f"  UCX {rec['ucx_gbps']} GB/s vs in-process copy {rec['d2d_gbps']} GB/s "
            f"({rec['ucx_over_d2d']}x the time; transports {used or 'not reported'})")


def _child(argv: list[str]) -> int:
    """The sender: ``ADDRESS_HEX BLOCKS SIZE DEVICE TIMEOUT_S``; then "send <round>" (each
    block as tag (round, index)) and "quit" on stdin, answers on stdout after ``SAY``."""
    t0 = time.monotonic()
    address, n, size, device, timeout = argv[0], int(argv[1]), int(argv[2]), argv[3], float(argv[4])

    def say(**msg: Any) -> None:
        print(SAY + json.dumps(msg), flush=True)

    lib, Array = _ucxx()
    import torch

    from kvstore.net.ucx import UcxError, wait

    cuda = device == "cuda"
    _, vals = blocks(n, size)
    src = [v.to(device) for v in vals]
    if cuda:
        torch.cuda.synchronize()
    arrays = [Array(b) for b in _buffers(src, cuda)]
    _context, worker = _worker(lib, cuda)
    ep = lib.UCXEndpoint.create_from_worker_address(
        worker, lib.UCXAddress.create_from_buffer(bytes.fromhex(address)), True)
    say(ready=True, seconds=round(time.monotonic() - t0, 2))
    code = 0
    for line in sys.stdin:  # EOF: the parent is gone
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        rnd = int(cmd[1])
        t1 = time.perf_counter()
        reqs = [ep.tag_send(a, lib.UCXXTag(_tag(rnd, i))) for i, a in enumerate(arrays)]
        try:
            wait(reqs, time.monotonic() + timeout)
        except UcxError as e:
            say(error=str(e))
            code = 1
            break
        say(sent=rnd, seconds=round(time.perf_counter() - t1, 6))
    try:
        ep.close_blocking()
    finally:
        worker.cancel_inflight_requests()
        worker.stop_progress_thread()
    return code


if __name__ == "__main__":
    try:
        sys.exit(_child(sys.argv[1:]))
    except Unsupported as e:
        print(SAY + json.dumps({"error": str(e)}), flush=True)
        sys.exit(3)
