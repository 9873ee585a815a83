"""Measures the engine on this machine: ``run_profile(ProfileSettings(...)) -> Profile``.

Everything runs through the serving code path: ``engine.model.runner.ModelRunner.execute``
over its own paged cache (the call ``LLMEngine.step`` makes), and the store curves through
``engine.kv.connector.KVStoreConnector`` against a real ``kvstore serve`` daemon on loopback
that this module starts (a child process, its own session) and stops.

- Prefill: a seeded random prompt of ``P`` tokens, ``c`` of them (0, 50 %, 90 %, rounded down
  to whole blocks, as the prefix cache hits) computed into the cache first (untimed); then
  the remaining ``P - c`` timed, in one step (unchunked, ``chunk`` 0) or in steps of
  ``chunk`` tokens (chunked, only for prompts longer than a chunk).
- Decode: ``batch`` sequences with ``context`` tokens each, in distinct blocks of a cache
  filled once with seeded normal values (decode time does not depend on the values; the
  pages are touched, not the kernel's shared zero page); one timed step of one token each.
- Store: ``blocks`` cache blocks saved (``save_blocks`` + ``flush`` until the daemon
  acknowledged them: copy out, encode, put; fresh keys each time so nothing is skipped) and
  loaded back (``load_blocks``: get, verify, scatter into other blocks).

Each point is the median of ``repeats`` timed runs after one warm-up run; a decode point, of
``decode_rounds`` rounds over every decode point (noise comes in bursts; see ``run_profile``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.profile.format import (
    Curve,
    DecodePoint,
    Hardware,
    ModelShape,
    PrefillPoint,
    Profile,
    StoreInfo,
    TransferPoint,
    fit_curve,
)

__all__ = ["ProfileSettings", "Grid", "default_grid", "run_profile", "cpu_model_name"]


@dataclass(frozen=True)
class Grid:
    """Where the curves are measured."""

    prefill_tokens: tuple[int, ...]
    cached_fractions: tuple[float, ...]
    chunk: int
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    store_blocks: tuple[int, ...]
    repeats: int
    decode_rounds: int  # timed rounds over every decode point


def default_grid(quick: bool, max_positions: int, chunk: int | None = None) -> Grid:
    """The full grid (over 7 minutes for SmolLM2-135M on 2 contended CPU cores) or ``quick``'s."""
    if quick:
        g = Grid((64, 256, 512), (0.0, 0.5, 0.9), chunk or 128, (1, 4, 16), (128, 512),
                 (1, 8, 32), 1, 1)
    else:
        g = Grid((64, 128, 256, 512, 1024, 2048), (0.0, 0.5, 0.9), chunk or 512,
                 (1, 2, 3, 4, 6, 8, 12, 16, 24, 32), (128, 512, 1024, 2048), (1, 4, 16, 64), 3, 9)
    fits = lambda n: n + 1 <= max_positions  # noqa: E731
    return Grid(tuple(n for n in g.prefill_tokens if fits(n)), g.cached_fractions, g.chunk,
                g.decode_batches, tuple(c for c in g.decode_contexts if fits(c)),
                g.store_blocks, g.repeats, g.decode_rounds)


@dataclass(frozen=True)
class ProfileSettings:
    model_dir: Path
    model_name: str
    device: str = "cpu"
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    seed: int = 0
    quick: bool = False
    chunk: int | None = None
    block_size: int = 16
    progress: bool = True


def cpu_model_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _median_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextlib.contextmanager
def _daemon(memory_bytes: int) -> Iterator[tuple[str, str]]:
    """A loopback ``kvstore serve`` with a fresh secret: yields (address, secret)."""
    from kvstore.daemon.local import start_local, stop_local

    secret = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="kvengine-profile-") as tmp:
        sfile = Path(tmp) / "secret"
        sfile.write_text(secret)
        sfile.chmod(0o600)
        proc, address = start_local(f"{max(64, memory_bytes >> 20)}M", secret_file=sfile,
                                    popen=lambda argv, **kw: subprocess.Popen(argv, start_new_session=True, **kw))
        try:
            yield address, secret
        finally:
            stop_local(proc)


def _tokens(gen: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


def run_profile(s: ProfileSettings) -> Profile:
    """Measure every curve and fit it (module docstring)."""
    from tqdm import tqdm

    from engine.model.native import native_status
    from engine.model.runner import ModelRunner, StepItem

    if s.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch.cuda.is_available() is False on this machine")
    if s.threads is not None:
        torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed)
    from engine.model.config import ModelConfig

    cfg = ModelConfig.from_dir(s.model_dir)
    grid = default_grid(s.quick, cfg.max_position_embeddings, s.chunk)
    bs = s.block_size
    blk = lambda n: -(-n // bs)  # noqa: E731
    per_seq = blk(max(grid.decode_contexts) + 1)
    decode_blocks = max(grid.decode_batches) * per_seq
    prefill_blocks = blk(max(grid.prefill_tokens))
    store_blocks = 2 * max(grid.store_blocks)
    runner = ModelRunner(s.model_dir, num_blocks=max(decode_blocks, prefill_blocks, store_blocks),
                         block_size=bs, device=s.device)
    dev = runner.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    cache_gen = torch.Generator(device=dev).manual_seed(s.seed)
    runner.kv_cache.normal_(generator=cache_gen)
    vocab = cfg.vocab_size

    prefill_cases = [(n, f, 0) for n in grid.prefill_tokens for f in grid.cached_fractions]
    prefill_cases += [(n, f, grid.chunk) for n in grid.prefill_tokens
                      for f in grid.cached_fractions if n - (int(n * f) // bs) * bs > grid.chunk]
    decode_cases = [(b, c) for c in grid.decode_contexts for b in grid.decode_batches]
    total = len(prefill_cases) + grid.decode_rounds + 2 * len(grid.store_blocks)
    bar = tqdm(total=total, desc="kvengine profile", unit="step", file=sys.stderr,
               disable=not s.progress)

    prefill: list[PrefillPoint] = []
    for n, frac, chunk in prefill_cases:
        bar.set_postfix_str(f"prefill {n} tok, {frac:.0%} cached, chunk {chunk or '-'}")
        prompt = _tokens(gen, vocab, n)
        table = list(range(blk(n)))
        cached = (int(n * frac) // bs) * bs
        if cached:
            runner.execute([StepItem(prompt[:cached], 0, table)])
        size = chunk or (n - cached)

        def run_prefill(prompt=prompt, cached=cached, size=size, table=table, n=n) -> None:
            for a in range(cached, n, size):
                runner.execute([StepItem(prompt[a:min(n, a + size)], a, table)])

        sec = _median_time(run_prefill, grid.repeats, sync)
        prefill.append(PrefillPoint(n - cached, cached, chunk, sec))
        bar.update(1)

    # A decode step takes tens of milliseconds and a shared machine's noise comes in bursts
    # longer than that, so the repeats are rounds over every decode point rather than back to
    # back: a burst costs each point at most a sample or two, not its median.
    steps = [[StepItem(_tokens(gen, vocab, 1), ctx, list(range(i * per_seq, (i + 1) * per_seq)))
              for i in range(b)] for b, ctx in decode_cases]
    times: list[list[float]] = [[] for _ in steps]
    for r in range(grid.decode_rounds + 1):  # round 0 is the warm-up
        bar.set_postfix_str(f"decode round {r}/{grid.decode_rounds}" if r else "decode warm-up")
        for items, seen in zip(steps, times):
            t0 = time.perf_counter()
            runner.execute(items)
            sync()
            if r:
                seen.append(time.perf_counter() - t0)
        if r:
            bar.update(1)
    decode = [DecodePoint(b, ctx, statistics.median(seen)) for (b, ctx), seen in zip(decode_cases, times)]

    loads, saves, transport = _measure_store(runner, grid, gen, bar, sync)
    bar.close()

    kv_dtype = str(runner.dtype).removeprefix("torch.")
    elem = runner.kv_cache.element_size()
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem
    native = native_status().split(" ")[0] if dev.type == "cpu" and runner.dtype == torch.float32 else "torch"
    hardware = Hardware(
        device=dev.type,
        device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model_name(),
        cpu_count=os.cpu_count() or 1, threads=torch.get_num_threads(),
        torch_version=torch.__version__, platform=platform.platform(), native_attention=native)
    model = ModelShape(
        name=s.model_name, architecture=cfg.architecture, num_layers=cfg.num_layers,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size, dtype=kv_dtype, block_size=bs,
        kv_bytes_per_token=per_token, block_bytes=per_token * bs)
    curves = {name: Curve(tuple(pts), fit_curve(name, pts)) for name, pts in
              (("prefill", prefill), ("decode", decode), ("store_load", loads), ("store_save", saves))}
    return Profile(
        hardware=hardware, model=model,
        store=StoreInfo(transport=transport, how=(
            "KVStoreConnector.save_blocks + flush (copy out, encode, put, acknowledged) and "
            "load_blocks (get, verify, scatter) against a loopback `kvstore serve` started for "
            "the run")),
        curves=curves, seed=s.seed, quick=s.quick, repeats=grid.repeats,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        extra={"chunk": grid.chunk, "prefill_tokens": list(grid.prefill_tokens),
               "cached_fractions": list(grid.cached_fractions),
               "decode_batches": list(grid.decode_batches),
               "decode_contexts": list(grid.decode_contexts), "decode_rounds": grid.decode_rounds,
               "store_blocks": list(grid.store_blocks)})


def _measure_store(runner, grid: Grid, gen: torch.Generator, bar, sync: Callable[[], None]
                   ) -> tuple[list[TransferPoint], list[TransferPoint], str]:
    from engine.kv.connector import KVStoreConnector
    from kvstore import codec
    from kvstore.client.node import Client
    from kvstore.keys import block_keys

    bs = runner.block_size
    conn_bytes = None
    saves_total = sum(grid.store_blocks) * (grid.repeats + 1)
    shape = (runner.kv_cache.shape[0], 2, *runner.kv_cache.shape[3:])
    encoded = codec.encoded_size(str(runner.dtype).removeprefix("torch."), shape)
    loads: list[TransferPoint] = []
    saves: list[TransferPoint] = []
    namespace = bytes(torch.randint(0, 256, (16,), generator=gen, dtype=torch.uint8).tolist())
    with _daemon(int(saves_total * encoded * 1.3) + (64 << 20)) as (address, secret):
        client = Client(address, auth_token=secret, timeout=60)
        save_client = Client(address, auth_token=secret, timeout=60)
        conn = KVStoreConnector(client, runner.kv_cache, save_client=save_client, save_all=True)
        conn_bytes = conn.payload_bytes
        counter = [0]
        try:
            for n in grid.store_blocks:
                bar.set_postfix_str(f"store save {n} blocks")
                src = list(range(n))
                last_keys: list = []

                def save_once(n=n, src=src, last_keys=last_keys) -> None:
                    counter[0] += 1
                    keys = block_keys(namespace, [counter[0] % 50000 + 3] + _tokens(gen, 1 << 20, n * bs - 1), bs)
                    rid = f"profile-{counter[0]}"
                    conn.save_blocks(keys, src, request_id=rid)
                    res = conn.flush(rid).result(timeout=300)
                    if res.saved_blocks != n:
                        raise RuntimeError(f"saved {res.saved_blocks} of {n} blocks: {res}")
                    last_keys[:] = keys

                saves.append(TransferPoint(n, n * conn_bytes, _median_time(save_once, grid.repeats, sync)))
                bar.update(1)
                bar.set_postfix_str(f"store load {n} blocks")
                dst = list(range(runner.num_blocks - 1, runner.num_blocks - 1 - n, -1))

                def load_once(n=n, dst=dst, keys=list(last_keys)) -> None:
                    r = conn.load_blocks(keys, dst)
                    if r.loaded != n:
                        raise RuntimeError(f"loaded {r.loaded} of {n} blocks: {r}")

                loads.append(TransferPoint(n, n * conn_bytes, _median_time(load_once, grid.repeats, sync)))
                bar.update(1)
            transport = client.transport
        finally:
            conn.close()
            client.close()
            save_client.close()
    return loads, saves, transport
