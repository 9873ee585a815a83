"""``kvrouter up`` as a user runs it: it comes up part by part, the ``curl`` line and the
``openai`` snippet it prints work as printed, and SIGTERM stops every child, leaving none."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from router.cluster.launcher import ClusterSpec, LaunchError, resolve_model_dir

pytestmark = pytest.mark.integration

VENV_BIN = str(Path(sys.executable).parent)


class Lines:
    """A child's stdout, line by line, read on a thread so waits can have deadlines."""

    def __init__(self, stream) -> None:
        self.seen: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def until(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {timeout} s; got:\n"
                                     + "\n".join(self.seen)) from None
            if line is None:
                raise AssertionError(f"output ended before {pattern!r}; got:\n" + "\n".join(self.seen))
            self.seen.append(line)
            if re.search(pattern, line):
                return line


def _descendants(pid: int) -> set[int]:
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = (task / "children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                if k not in out:
                    out.add(k)
                    todo.append(k)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_kvrouter_up_serves_and_stops_cleanly(tiny_model_dir: Path, tmp_path: Path, free_port) -> None:
    port = free_port()
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "up", "--model", str(tiny_model_dir),
         "--port", str(port), "--prefill", "1", "--decode", "1", "--log-dir", str(tmp_path / "logs"),
         "--store-memory", "64M"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)
    out = Lines(proc.stdout)
    try:
        for part in ("etcd ready", "store ready", "prefill worker .* ready", "decode worker .* ready",
                     "router ready"):
            out.until(part, 120)
        curl = out.until(r"^curl ", 30)
        out.until(r"^python - <<'EOF'$", 5)
        snippet = [out.until(r".*", 5)]
        while snippet[-1] != "EOF":
            snippet.append(out.until(r".*", 5))
        out.until("Ctrl-C stops everything", 5)
        children = _descendants(proc.pid)
        assert len(children) >= 5                  # etcd, store, 2 workers, router

        # The printed commands work as printed.
        done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        body = json.loads(done.stdout)
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] >= 1
        done = subprocess.run(["bash", "-c", "python - <<'EOF'\n" + "\n".join(snippet) + "\n"],
                              capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0, "\n".join(out.seen)
    out.until("all stopped", 5)
    stopped = {m.group(1): m.group(2) for line in out.seen
               if (m := re.search(r"stopped (\S+) \(exit (-?\d+)\)$", line))}
    assert stopped.keys() == {"router", "decode-0", "prefill-0", "store", "etcd"}
    assert all(stopped[name] == "0" for name in ("router", "decode-0", "prefill-0", "store")), stopped
    assert not [pid for pid in children if _alive(pid)]


def test_up_refuses_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="not a checkpoint"):
        resolve_model_dir(str(tmp_path))
    with pytest.raises(ValueError, match="decode worker"):
        ClusterSpec(decode=0)
