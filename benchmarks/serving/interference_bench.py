"""Interference: how much a decode worker's running streams' inter-token latency (ITL) grows
while prompts' KV loads from the store, with the loads on the engine thread (old) or on the
connector's I/O threads (new).

    .venv/bin/python -m benchmarks.serving.interference_bench            # shm and tcp, N = 4 and 16 (~5 min)
    .venv/bin/python -m benchmarks.serving.interference_bench --quick --out /tmp/interference
    .venv/bin/python -m benchmarks.serving.interference_bench --report docs/results/interference.json

Method. A decode engine (``LLMEngine`` over the default model, SmolLM2-135M in float32, one
torch thread: the second core is left for I/O) streams N sequences (32-token random prompts,
greedy, ``ignore_eos``, long ``max_tokens``) while handoffs arrive: prompts of 2,048 and 7,500
random tokens, alternating, each generating one token. Every arriving prompt is distinct, and
its full blocks are in the store beforehand: their keys are the engine's own
(``kvstore.keys.block_keys`` under ``engine.namespace``; the arrival carries them as
``block_keys``, which the engine checks), their values random KV of the cache's dtype and block
shape, encoded with ``kvstore.codec``. So an arrival loads everything but its last partial
block from the store and computes only that. The engine is driven as the worker drives it: a
loop of ``engine.step()``, ``engine.wait_for_io`` when ``engine.waiting_on_io``; arrivals are
added between steps at their scheduled times.

Stores: ``shm``, a ``kvstore serve`` daemon on this host (the client maps its arena: shared
memory); ``tcp``, a daemon on another host of the multi-host harness
(``router.cluster.hosts.Hosts``: a network namespace a host, a veth into a bridge; needs root),
reached over TCP. In both, the engine side is a child process (inside host 0 for ``tcp``) that
prints its JSON back; daemons and clients share a fresh cluster secret (a file).

Three runs per (store, N), interleaved in segments of 6 arrivals (long, short, long, ...),
one segment of each run per round, the order rotated every round (3 rounds by default):
``baseline`` (the same arrivals with their KV already in the device cache: no load; its two
prompts are run once, untimed, before each baseline segment, which puts them back at the
front of the cache's LRU order), ``old`` (the connector with ``io="inline"``: lookups and loads
on the engine thread, the step waits for them) and ``new`` (``io="threads"``: a lookup thread
and a loader thread). One ``LLMEngine``; the connector under test is switched between
segments, never while I/O is in flight; both connectors share three clients (load, save,
lookup: as ``kvengine serve`` does, so a lookup never waits behind a load); nothing is saved
(a decode worker saves nothing by default). Between segments (untimed): the next segment's
prompts are put in the store, the last one's deleted; the streams restart when they have
generated 768 tokens. The arrival interval is calibrated once per store, before the streams
start: a store-hit arrival of each size through each path, alone, twice (the first pass warms
buffers up), interval = the second pass's mean TTFT (add -> first token: lookup, load, the
last block's compute) / ``--inflight`` (0.4), so an arrival is in flight ~40% of the time or
more (the streams lengthen every step) and a load 5-15% of it. Spacing them by the load
alone (mean load seconds / 0.3) was tried first: a shared-memory load (40-150 ms) is shorter
than one step here, so arrivals came faster than the engine computed their last blocks; the
runs measured a queue of those computations (20-35 steps a run, TTFT growing), not the loads.
Each segment: the streams take two steps, then the window starts (the time of their last
token); arrivals are added between steps once their time (window start + i x interval) has
come; the window ends at the first step ending after every arrival produced its token and
6 x interval passed.

Fields (``runs.{store}.{nN}.{baseline,old,new}``; times in ms where named so; absolute times
are this machine's, only the ratios are results):

- ``p50_itl_ms``, ``p90_itl_ms``, ``p99_itl_ms``, ``mean_itl_ms``: percentiles (linear
  interpolation) of the gaps between each stream's consecutive tokens inside the windows,
  pooled over the run's segments and streams; ``gaps``, ``steps``: how many;
- ``decode_*``: the same without the gaps that end at a step which computed an arrival's last
  prompt tokens (that step costs the same in all three runs; on this CPU engine, 12-16 query
  tokens against a 7.5k-token context cost more than a decode step, so it sets the plain p99
  in every run): what is left is the steps that decode only, and in ``old`` those that also
  ran a lookup and a load;
- ``step_ms``: median wall time of one ``engine.step()`` inside the windows;
- ``ttft_ms``: median store-hit TTFT of the arrivals (added -> first token);
- ``inflight_frac``: the arrivals' summed add -> first-token time over the summed window
  time (above 1 when arrivals overlap); ``load_frac``: the loads' summed busy seconds (the
  connector's ``LoadTally.seconds``) over the same;
- ``arrivals``, ``store_hits``, ``device_hits``: arrivals, and how many of them loaded every
  prompt block but the computed last one from the store / found them all in the device cache;
- ``load_ms``: mean load busy time of an arrival (old, new).

Per store (``stores.{store}``): the calibration, the client's transport, preemptions and
abandoned loads (both should be 0), each connector's counters, the 1-minute load average at
the start and the end (the machine is shared; interleaving is what keeps the ratios fair).

Comparisons (``compare.{store}.{nN}``; ``before.{store}.{nN}`` repeats the old path's,
``after.{store}.{nN}`` the new path's):

- ``{old,new}_p50_itl_ratio``, ``{old,new}_p99_itl_ratio``: over baseline, in the same run;
  ``{old,new}_decode_p50_itl_ratio`` / ``..._decode_p99_itl_ratio``: the same of ``decode_*``;
- ``excess_old`` = old's p99 ratio - 1, ``excess_new`` likewise; ``excess_cut`` =
  1 - excess_new / excess_old: the share of the old path's p99 excess the new path removes
  (null when the old path has none); ``decode_excess_*``: the same of the decode-only p99;
- ``ttft_old_ms``, ``ttft_new_ms``, ``ttft_extra_steps`` = (new - old) / baseline ``step_ms``.

Targets (``targets``; ``met`` has a boolean for each, on the plain p99; ``met_decode_only``
the two ITL ones on the decode-only p99): the new path's p99 ITL
ratio at most 1.15 over shared memory and 1.3 over TCP; ``excess_cut`` at least 0.7 on both
stores (where the old path shows no p99 excess the cut is null, and counted met only if the
new path shows none either); the new path's store-hit TTFT no more than one step worse than
the old path's. ``all_met``: every one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks import lifecycle
from benchmarks.lifecycle import REPO
from benchmarks.report import emit, machine_info, write_json
from benchmarks.serving.interference_figures import (
    MODES,
    plot,
    rounded,
    run_figures,
    segment_order,
    stream_gaps,
    summarize,
    table,
)

if TYPE_CHECKING:
    from engine.core.connector_api import LoadDone
    from engine.core.llm_engine import LLMEngine
    from engine.core.request import Request
    from engine.kv.connector import KVStoreConnector
    from kvstore.keys import BlockKey

BLOCK_SIZE = 16
IO = {"old": "inline", "new": "threads"}
STORE_PORT = 7700
WARM_STEPS = 2
PER_SEGMENT = 6  # arrivals a segment: long, short, long, short, ...
_SECRET_ENV = ("KVSTORE_AUTH_TOKEN", "KVCACHE_CLUSTER_SECRET", "KVCACHE_CLUSTER_SECRET_FILE")
_ROLE = "import sys; from benchmarks.serving.interference_bench import child; child(sys.argv[1])"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.interference_bench",
                                description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stores", nargs="+", choices=["shm", "tcp"], default=None,
                   help="stores to measure: shm (a daemon on this host), tcp (a daemon on "
                        "another host of the harness; root) (default: shm tcp; --quick: shm)")
    p.add_argument("--n", type=int, nargs="+", default=None,
                   help="running streams N (default: 4 16; --quick: 4)")
    p.add_argument("--arrivals", type=int, default=None,
                   help=f"arrivals per run, a multiple of {PER_SEGMENT} (default: 18; --quick: 6)")
    p.add_argument("--sizes", type=int, nargs=2, default=None, metavar=("SHORT", "LONG"),
                   help="arriving prompts' tokens, alternating (default: 2048 7500; "
                        "--quick: 512 1536)")
    p.add_argument("--stream-prompt", type=int, default=32,
                   help="tokens of each stream's prompt (default: 32)")
    p.add_argument("--inflight", type=float, default=0.4,
                   help="target share of the time an arrival is in flight (added, no token "
                        "yet): interval = mean calibrated store-hit TTFT / this (default: 0.4)")
    p.add_argument("--model", default=None,
                   help="'default' (SmolLM2-135M), 'tiny' (a random checkpoint made in a "
                        "temporary directory) or a checkpoint directory (default: default; "
                        "--quick: tiny)")
    p.add_argument("--memory", default=None,
                   help="each store daemon's arena (default: 3G; --quick: 256M)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and KV (default: 0)")
    p.add_argument("--quick", action="store_true",
                   help="a short check: tiny model, N = 4, 6 arrivals a run, shm only; writes "
                        "files only with --out")
    p.add_argument("--out", type=Path, default=None,
                   help="write interference.json and interference.png here (default: "
                        "docs/results; --quick: nothing written)")
    p.add_argument("--report", type=Path, default=None,
                   help="recompute and print the figures of a saved interference.json and "
                        "plot them beside it (or into --out); runs nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


# --- the arithmetic (pure; tests/benchmarks/test_interference.py) ----------------------------


# --- the engine side (a child process; inside host 0 for tcp) --------------------------------


class _Switch:
    """The engine's connector: forwards to the connector under test, switched between
    segments (only while nothing is loading)."""

    def __init__(self, conns: Mapping[str, KVStoreConnector]) -> None:
        self.conns = dict(conns)
        self.active = self.conns["new"]

    def use(self, mode: str) -> None:
        self.active = self.conns["old" if mode == "old" else "new"]

    def lookup_ahead(self, req: Request) -> None:
        self.active.lookup_ahead(req)

    def get_num_external_hits(self, req: Request, num_device_hit_tokens: int) -> int | None:
        return self.active.get_num_external_hits(req, num_device_hit_tokens)

    def start_load(self, req: Request, block_ids: Sequence[int]) -> None:
        self.active.start_load(req, block_ids)

    def finished_loads(self) -> list[LoadDone]:
        return self.active.finished_loads()

    def wait(self, timeout: float) -> None:
        self.active.wait(timeout)

    def save(self, req: Request, block_ids: Sequence[int], keys: Sequence[BlockKey],
             held: bool = False) -> None:
        self.active.save(req, block_ids, keys, held)

    def request_finished(self, req: Request) -> None:
        self.active.request_finished(req)


@dataclass
class _Prompt:
    tokens: list[int]
    keys: list[BlockKey]

    @property
    def hit_tokens(self) -> int:
        """Tokens an arrival takes from a cache: every full block but a last one computed."""
        return (len(self.tokens) - 1) // BLOCK_SIZE * BLOCK_SIZE


@dataclass
class _Arrival:
    rid: str
    prompt: _Prompt
    added: float
    first: float | None = None
    device_hit_tokens: int = 0
    store_hit_tokens: int = 0
    load_s: float = 0.0


@dataclass
class _Run:
    gaps: list[float] = field(default_factory=list)
    decode_gaps: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    arrivals: list[_Arrival] = field(default_factory=list)
    window_s: float = 0.0


class _Bench:
    """The engine side of one store: the engine, its two connectors, the store's prompts."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        import numpy as np
        import torch

        from engine.core.config import EngineConfig
        from engine.core.llm_engine import LLMEngine
        from engine.kv.connector import KVStoreConnector
        from engine.model.runner import ModelRunner
        from kvstore import Client
        from kvstore.keys import salted

        torch.set_num_threads(1)
        self.cfg = cfg
        self.rng = random.Random(cfg["seed"])
        short, long = cfg["sizes"]
        self.cap = cfg["stream_cap"]
        blocks = (-(-short // BLOCK_SIZE) + -(-long // BLOCK_SIZE)  # the baseline's two prompts
                  + 4 * -(-long // BLOCK_SIZE)                       # arrivals in flight
                  + max(cfg["ns"]) * -(-(cfg["stream_prompt"] + self.cap + 64) // BLOCK_SIZE) + 32)
        self.runner = ModelRunner(cfg["model"], num_blocks=blocks, block_size=BLOCK_SIZE)
        self.vocab = self.runner.config.vocab_size
        self.max_len = self.runner.config.max_position_embeddings
        kv = self.runner.kv_cache
        clients = [Client(cfg["store"], timeout=60) for _ in range(4)]
        self.clients = clients
        self.putter = clients[3]  # puts and deletes, between segments
        self.transport = clients[0].transport
        if self.transport != cfg["transport"]:
            raise SystemExit(f"interference_bench: the client reaches the {cfg['kind']} store over "
                             f"{self.transport}, expected {cfg['transport']}")
        # One connector a path, the same three clients (load, save, lookup); only one is in use
        # at a time.
        self.conns = {mode: KVStoreConnector(clients[0], kv, save_client=clients[1],
                                             lookup_client=clients[2], save_all=False,
                                             io="inline" if mode == "old" else "threads")
                      for mode in ("old", "new")}
        self.switch = _Switch(self.conns)
        self.engine: LLMEngine = LLMEngine(
            self.runner, EngineConfig(num_blocks=blocks, block_size=BLOCK_SIZE, max_num_seqs=64),
            connector=self.switch)
        self.namespace = salted(self.engine.namespace, None)
        conn = self.conns["new"]
        self.block_shape, self.dtype_name = conn.block_shape, conn.dtype_name
        self.encoded = conn.encoded_bytes
        g = torch.Generator().manual_seed(cfg["seed"])
        pool = (torch.randn((16, *self.block_shape), generator=g) * 0.5).to(conn.dtype).contiguous()
        self.pool = pool.view(torch.uint8).reshape(16, -1).numpy()
        self.rows = np.empty((-(-long // BLOCK_SIZE), self.encoded), np.uint8)
        self.streams: dict[str, int] = {}   # running stream -> tokens generated
        self.live: dict[str, _Arrival] = {}
        self.tokens: dict[str, list[float]] | None = None  # a window's stream token times
        self.steps: list[float] | None = None
        self.computed: set[float] = set()  # a window's step ends that computed an arrival
        self.seq = 0
        self.preemptions0 = self.engine.scheduler.num_preemptions

    # -- prompts in the store --

    def prompt(self, n: int) -> _Prompt:
        from kvstore.keys import block_keys

        tokens = [self.rng.randrange(self.vocab) for _ in range(n)]
        return _Prompt(tokens, block_keys(self.namespace, tokens, BLOCK_SIZE))

    def put(self, p: _Prompt) -> None:
        from kvstore import codec

        rows = self.rows
        n = len(p.keys)
        for i, key in enumerate(p.keys):
            rows[i, codec.HEADER_SIZE:] = self.pool[i % len(self.pool)]
            codec.seal(rows[i], key, self.dtype_name, self.block_shape)
        held = self.putter.put(p.keys, [rows[i] for i in range(n)])
        if not all(held):
            raise SystemExit(f"interference_bench: the store took {sum(held)} of {n} blocks "
                             "(raise --memory)")

    def delete(self, p: _Prompt) -> None:
        self.putter.delete(p.keys)

    # -- driving the engine --

    def _params(self, max_tokens: int) -> Any:
        from engine.api.generate import SamplingParams

        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def step(self) -> float:
        t0 = time.perf_counter()
        outs = self.engine.step()
        t = time.perf_counter()
        computed = False
        for out in outs:
            rid = out.request_id
            if rid in self.streams:
                if out.finished:
                    raise RuntimeError(f"stream {rid} ended ({out.finish_reason}) mid-run")
                self.streams[rid] += len(out.new_token_ids)
                if self.tokens is not None and out.new_token_ids:
                    self.tokens[rid].append(t)
            elif (a := self.live.get(rid)) is not None:
                if a.first is None and out.new_token_ids:
                    a.first, computed = t, True
                if out.finished:
                    del self.live[rid]
                    a.device_hit_tokens, a.store_hit_tokens = out.stats.device_hit_tokens, out.stats.store_hit_tokens
                    a.load_s = out.kv.load.seconds
        if self.steps is not None:
            self.steps.append(t - t0)
            if computed:
                self.computed.add(t)
        return t

    def add(self, p: _Prompt, tag: str) -> _Arrival:
        self.seq += 1
        a = _Arrival(f"{tag}-{self.seq}", p, time.perf_counter())
        self.live[a.rid] = a
        self.engine.add_request(a.rid, p.tokens, self._params(1), block_keys=p.keys)
        return a

    def run_alone(self, prompts: Sequence[_Prompt], tag: str) -> list[_Arrival]:
        """Arrivals added at once and run to their token (the streams, if any, step along),
        untimed."""
        added = [self.add(p, tag) for p in prompts]
        while any(a.rid in self.live for a in added):
            if self.engine.waiting_on_io:
                self.engine.wait_for_io(0.01)
            self.step()
        return added

    def stop_streams(self) -> None:
        old, self.streams = self.streams, {}
        for rid in old:
            self.engine.abort(rid)
        self.step()  # the aborted streams' final outputs

    def start_streams(self, n: int) -> None:
        self.stop_streams()
        most = min(4096, self.max_len - self.cfg["stream_prompt"] - 1)
        for _ in range(n):
            self.seq += 1
            rid = f"stream-{self.seq}"
            self.streams[rid] = 0
            tokens = [self.rng.randrange(self.vocab) for _ in range(self.cfg["stream_prompt"])]
            self.engine.add_request(rid, tokens, self._params(most))
        while min(self.streams.values()) == 0:
            if self.engine.waiting_on_io:
                self.engine.wait_for_io(0.01)
            self.step()

    # -- the measurement --

    def calibrate(self) -> dict[str, Any]:
        """Store-hit arrivals of each size through each path, alone (no streams), twice (the
        first pass warms the buffers up): the interval from the second pass's mean TTFT."""
        loads: dict[str, list[float]] = {"old": [], "new": []}
        ttfts: dict[str, list[float]] = {"old": [], "new": []}
        for keep in (False, True):
            for mode in ("old", "new"):
                self.switch.use(mode)
                for size in self.cfg["sizes"]:
                    p = self.prompt(size)
                    self.put(p)
                    (a,) = self.run_alone([p], f"calibrate-{mode}")
                    self.delete(p)
                    if a.store_hit_tokens != p.hit_tokens or a.first is None:
                        raise SystemExit(f"interference_bench: calibration loaded {a.store_hit_tokens} "
                                         f"of {p.hit_tokens} tokens from the store")
                    if keep:
                        loads[mode].append(a.load_s)
                        ttfts[mode].append(a.first - a.added)
        ttft = statistics.fmean(ttfts["old"] + ttfts["new"])
        interval = max(self.cfg["min_interval"], ttft / self.cfg["inflight"])
        return {"load_ms": {m: [rounded(s * 1e3) for s in v] for m, v in loads.items()},
                "ttft_ms": {m: [rounded(s * 1e3) for s in v] for m, v in ttfts.items()},
                "mean_load_ms": rounded(statistics.fmean(loads["old"] + loads["new"]) * 1e3),
                "mean_ttft_ms": rounded(ttft * 1e3), "interval_s": rounded(interval, 4)}

    def segment(self, mode: str, prompts: list[_Prompt], interval: float, run: _Run) -> None:
        assert not self.live and self.engine.num_loading == 0
        self.switch.use(mode)
        t_w = 0.0
        for _ in range(WARM_STEPS):
            t_w = self.step()
        self.tokens = {rid: [t_w] for rid in self.streams}
        self.steps, self.computed = [], set()
        t0 = time.perf_counter()
        added: list[_Arrival] = []
        end = t0 + len(prompts) * interval
        try:
            while True:
                now = time.perf_counter()
                while len(added) < len(prompts) and now >= t0 + len(added) * interval:
                    added.append(self.add(prompts[len(added)], mode))
                if self.engine.waiting_on_io:
                    self.engine.wait_for_io(0.002)
                t = self.step()
                if len(added) == len(prompts) and not self.live and t >= end:
                    break
            run.gaps += stream_gaps(self.tokens)
            run.decode_gaps += stream_gaps(self.tokens, self.computed)
            run.steps += self.steps
            run.arrivals += added
            run.window_s += t - t_w
        finally:
            self.tokens, self.steps = None, None

    def measure(self, progress: Any) -> dict[str, Any]:
        cfg = self.cfg
        t_start = time.perf_counter()
        load0 = os.getloadavg()
        short, long = cfg["sizes"]
        base = [self.prompt(long), self.prompt(short)]
        for p in base:
            self.put(p)
        calibration = self.calibrate()
        interval = calibration["interval_s"]
        per = PER_SEGMENT
        rounds = cfg["arrivals"] // per
        runs: dict[str, Any] = {}
        for n in cfg["ns"]:
            self.start_streams(n)
            raw = {m: _Run() for m in MODES}
            for mode in segment_order(rounds):
                if max(self.streams.values()) > self.cap:
                    self.start_streams(n)
                if mode == "baseline":
                    # their blocks into (or back to the front of) the device cache's LRU order
                    self.run_alone(base, "prime")
                    prompts = [base[i % 2] for i in range(per)]
                else:
                    prompts = [self.prompt(long if i % 2 == 0 else short) for i in range(per)]
                    for p in prompts:
                        self.put(p)
                self.segment(mode, prompts, interval, raw[mode])
                if mode != "baseline":
                    for p in prompts:
                        self.delete(p)
                progress.update(1)
            runs[f"n{n}"] = {m: self._figures(m, r) for m, r in raw.items()}
        self.stop_streams()
        stats = {m: c.stats_snapshot().to_json() for m, c in self.conns.items()}
        return {
            "store": cfg["kind"], "transport": self.transport, "model": Path(cfg["model"]).name,
            "block_bytes": self.encoded, "num_blocks": self.engine.config.num_blocks,
            "sizes": list(cfg["sizes"]), "stream_prompt": cfg["stream_prompt"],
            "arrivals_per_run": rounds * per, "calibration": calibration, "runs": runs,
            "preemptions": self.engine.scheduler.num_preemptions - self.preemptions0,
            "abandoned_loads": self.engine.scheduler.num_abandoned_loads,
            "connector_stats": stats, "elapsed_s": rounded(time.perf_counter() - t_start, 1),
            "loadavg_1min": {"start": rounded(load0[0], 2), "end": rounded(os.getloadavg()[0], 2)},
        }

    def _figures(self, mode: str, run: _Run) -> dict[str, Any]:
        ttfts = [a.first - a.added for a in run.arrivals if a.first is not None]
        out = run_figures(run.gaps, run.decode_gaps, run.steps, ttfts, run.window_s,
                          sum(a.load_s for a in run.arrivals))
        out["arrivals"] = len(run.arrivals)
        out["store_hits"] = sum(a.store_hit_tokens == a.prompt.hit_tokens and a.device_hit_tokens == 0
                                for a in run.arrivals)
        out["device_hits"] = sum(a.device_hit_tokens == a.prompt.hit_tokens and a.store_hit_tokens == 0
                                 for a in run.arrivals)
        if mode != "baseline":
            out["load_ms"] = rounded(statistics.fmean(a.load_s for a in run.arrivals) * 1e3)
        return out

    def close(self) -> None:
        for c in self.conns.values():
            c.close()
        for c in self.clients:
            c.close()


def child(config_json: str) -> None:
    """Entry of the engine-side process: one JSON line on stdout."""
    from tqdm import tqdm

    cfg = json.loads(config_json)
    bench = _Bench(cfg)
    total = len(cfg["ns"]) * (cfg["arrivals"] // PER_SEGMENT) * len(MODES)
    try:
        with tqdm(total=total, desc=f"interference {cfg['kind']}", unit="segment",
                  file=sys.stderr, disable=not cfg["progress"]) as bar:
            result = bench.measure(bar)
    finally:
        bench.close()
    print(json.dumps(result), flush=True)


# --- the orchestrator ------------------------------------------------------------------------


def _env(secret: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SECRET_ENV}
    env["KVCACHE_CLUSTER_SECRET_FILE"] = str(secret)
    return env


def _child_result(proc: subprocess.Popen, what: str) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"interference_bench: the {what} engine side failed (exit {proc.returncode}); "
                         "its error is above")
    return json.loads(out.strip().splitlines()[-1])


def _run_shm(cfg: dict[str, Any], secret: Path, memory: str) -> dict[str, Any]:
    from kvstore.daemon.local import start_local

    try:
        daemon, address = start_local(memory, secret_file=secret, popen=lifecycle.popen, cwd=REPO)
    except RuntimeError as e:
        raise SystemExit(f"interference_bench: {e}") from None
    try:
        cfg = {**cfg, "kind": "shm", "store": address, "transport": "shm"}
        proc = lifecycle.popen([sys.executable, "-c", _ROLE, json.dumps(cfg)], env=_env(secret),
                               cwd=REPO, stdout=subprocess.PIPE, text=True)
        return _child_result(proc, "shm")
    finally:
        lifecycle.stop(daemon)


def _run_tcp(cfg: dict[str, Any], secret: Path, memory: str) -> dict[str, Any]:
    from kvstore.daemon.config import parse_size
    from kvstore.proc import read_line
    from router.cluster.hosts import Hosts, HostsError

    shm_size = f"{(parse_size(memory) + (256 << 20)) >> 20}M"
    try:
        hosts = Hosts(2, shm_size=shm_size).__enter__()
    except HostsError as e:
        raise SystemExit(f"interference_bench: cannot make the hosts for the tcp store: {e}") from None
    try:
        engine_host, store_host = hosts[0], hosts[1]
        env = _env(secret)
        daemon = store_host.popen(
            [sys.executable, "-m", "kvstore.daemon.cli", "serve", "--host", "0.0.0.0",
             "--port", str(STORE_PORT), "--memory", memory, "--log-level", "WARNING"],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready = read_line(daemon, "the store daemon", 60.0)
        except RuntimeError as e:
            raise SystemExit(f"interference_bench: {e}") from None
        address = f"{store_host.address}:{STORE_PORT}"
        if f"address={address}" not in ready:
            raise SystemExit(f"interference_bench: the daemon said {ready!r}")
        cfg = {**cfg, "kind": "tcp", "store": address, "transport": "tcp"}
        proc = engine_host.popen([sys.executable, "-c", _ROLE, json.dumps(cfg)], env=env,
                                 cwd=REPO, stdout=subprocess.PIPE, text=True)
        result = _child_result(proc, "tcp")
        result["link"] = {"kind": "veth pair into a Linux bridge, one network namespace a host",
                          "store_host": store_host.address, "engine_host": engine_host.address}
        return result
    finally:
        hosts.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every store's engine side in turn; their runs with the comparisons."""
    quick = args.quick
    stores = args.stores or (["shm"] if quick else ["shm", "tcp"])
    ns = args.n or ([4] if quick else [4, 16])
    arrivals = args.arrivals or (6 if quick else 18)
    if arrivals < PER_SEGMENT or arrivals % PER_SEGMENT:
        raise SystemExit(f"interference_bench: --arrivals must be a positive multiple of {PER_SEGMENT}")
    sizes = args.sizes or ([512, 1536] if quick else [2048, 7500])
    memory = args.memory or ("256M" if quick else "3G")
    model = args.model or ("tiny" if quick else "default")
    with tempfile.TemporaryDirectory(prefix="interference-") as tmpdir:
        tmp = Path(tmpdir)
        if model == "tiny":
            from engine.model.tiny import make_tiny_checkpoint

            model_dir = make_tiny_checkpoint(tmp / "tiny-model", "llama", seed=0)
        elif model == "default":
            from engine.model.convert import ensure_default_model

            model_dir = ensure_default_model()
        else:
            model_dir = Path(model)
        config = json.loads((model_dir / "config.json").read_text())
        most = int(config.get("max_position_embeddings", 0))
        if most and max(sizes) >= most:
            raise SystemExit(f"interference_bench: a {max(sizes)}-token prompt does not fit the "
                             f"model's {most}-token context")
        secret = tmp / "cluster-secret"
        secret.write_text(os.urandom(24).hex())
        secret.chmod(0o600)
        cfg = {"model": str(model_dir), "ns": ns, "arrivals": arrivals, "sizes": sizes,
               "stream_prompt": args.stream_prompt,
               "stream_cap": min(768, (most or 8192) - args.stream_prompt - 64),
               "inflight": args.inflight, "min_interval": 0.05, "seed": args.seed,
               "progress": not args.no_progress}
        per_store = {}
        for store in stores:
            per_store[store] = (_run_shm if store == "shm" else _run_tcp)(cfg, secret, memory)
    runs = {s: r["runs"] for s, r in per_store.items()}
    return {
        "bench": "interference", "quick": quick, "model": per_store[stores[0]]["model"],
        "threads": 1, "ns": ns, "sizes": sizes, "arrivals_per_run": arrivals,
        "stream_prompt": args.stream_prompt, "inflight_target": args.inflight,
        **summarize(runs), "runs": runs,
        "stores": {s: {k: v for k, v in r.items() if k != "runs"} for s, r in per_store.items()},
        "machine": machine_info(),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report is not None:
        result = json.loads(args.report.read_text())
        result.update(summarize(result["runs"]))
        png = (args.out / "interference.png") if args.out is not None else args.report.with_suffix(".png")
    else:
        result = run(args)
        out = args.out if args.out is not None or args.quick else REPO / "docs" / "results"
        png = None
        if out is not None:
            write_json(out / "interference.json", result)
            png = out / "interference.png"
    if png is not None:
        png.parent.mkdir(parents=True, exist_ok=True)
        plot(result, png)
    print(table(result), file=sys.stderr)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(lifecycle.run_main(main))
