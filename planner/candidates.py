"""The configurations ``kvplan recommend`` searches (``planner.recommend``'s docstring says why).

- :class:`Fleet`: what a budget buys on the hardware, the settings every candidate shares;
- :func:`candidates`: the CPU search, listed up front: one colocated worker with every CPU, a
  fleet of smaller ones, and every split (or those at ``prefill_shares``);
- GPU: :func:`gpu_colocated` (colocated x N per chunk size) and :func:`gpu_split` (P + D = N),
  with the split search's starts (:func:`split_starts`) and its hill climb (:func:`next_splits`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from planner.sim.config import ClusterConfig
from planner.sim.worker import WorkerSpec

__all__ = ["Fleet", "candidates", "gpu_colocated", "gpu_split", "split_starts", "next_splits", "devices_of"]


@dataclass(frozen=True)
class Fleet:
    """What a budget buys on this hardware: the settings every candidate's workers share."""

    gpu: bool
    devices: int                 # the budget
    threads: int                 # CPUs a worker (CPU profiles); 1 on a GPU profile
    num_blocks: int              # KV blocks of a GPU (GPU) or of the whole fleet (CPU)
    block_size: int
    max_num_seqs: int
    max_model_len: int
    store_memory: int
    device_memory_gib: float | None = None

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def candidates(devices: int, threads: int, chunks: list[int], num_blocks: int, max_model_len: int,
               store_memory: int, policy: str = "kv-aware", salt: bool = False,
               max_workers: int = 64, prefill_shares: list[float] | None = None,
               per_worker_blocks: bool = False, max_num_seqs: int = 64,
               max_colocated: int = 0, block_size: int = 16) -> list[ClusterConfig]:
    """The CPU search (module docstring); KV blocks are split evenly, so each candidate holds
    ``num_blocks`` device blocks in all (``per_worker_blocks``: each worker holds ``num_blocks``).
    ``prefill_shares`` limits the splits to those prefill shares of the workers (rounded; default
    every split); ``max_colocated`` > 0 caps the colocated fleets' size (``kvrouter up`` starts one)."""
    out: list[ClusterConfig] = []
    slots = min(devices // threads, max_workers)
    if slots < 1:
        raise ValueError(f"{devices} devices cannot hold one worker of {threads} threads")
    for chunk in chunks:
        base = WorkerSpec(max_model_len=max_model_len, max_num_batched_tokens=chunk or 2048,
                          enable_chunked_prefill=chunk > 0, max_num_seqs=max_num_seqs, block_size=block_size)
        share = (lambda k: num_blocks) if per_worker_blocks else (lambda k: num_blocks // k)
        tag = f"chunk{chunk}" if chunk else "nochunk"
        # One colocated worker with every device, and fleets of smaller ones.
        for k in sorted({1, slots} if not max_colocated else {1, min(slots, max_colocated)}):
            t = devices if k == 1 else threads
            spec = dataclasses.replace(base, role="colocated", threads=t, num_blocks=share(k))
            out.append(ClusterConfig(name=f"colo{k}x{t}t_{tag}", mode="colocated", prefill=0, decode=0,
                                     colocated=k, colocated_spec=spec, policy=policy,
                                     store_memory_bytes=store_memory, salt_per_request=salt))
        if chunk == 0:
            continue
        splits = range(1, slots) if prefill_shares is None else sorted(
            {min(max(round(f * slots), 1), slots - 1) for f in prefill_shares} if slots > 1 else set())
        for p in splits:
            d = slots - p
            each = share(p + d)
            out.append(ClusterConfig(
                name=f"split{p}p{d}d_{tag}", mode="disaggregated", prefill=p, decode=d,
                prefill_spec=dataclasses.replace(base, role="prefill", threads=threads, num_blocks=each),
                decode_spec=dataclasses.replace(base, role="decode", threads=threads, num_blocks=each),
                policy=policy, store_memory_bytes=store_memory, salt_per_request=salt))
    return out


def gpu_colocated(fleet: Fleet, chunks: list[int], policy: str = "kv-aware", salt: bool = False) -> list[ClusterConfig]:
    """The GPU search's colocated fleets: every device a colocated worker, one per chunk size."""
    chunks = sorted({c for c in chunks if c > 0}) or [2048]
    spec = WorkerSpec(role="colocated", max_model_len=fleet.max_model_len, max_num_seqs=fleet.max_num_seqs,
                      block_size=fleet.block_size, num_blocks=fleet.num_blocks)
    return [ClusterConfig(name=f"colo{fleet.devices}_chunk{c}", mode="colocated", prefill=0, decode=0,
                          colocated=fleet.devices, colocated_spec=dataclasses.replace(spec, max_num_batched_tokens=c),
                          policy=policy, store_memory_bytes=fleet.store_memory, salt_per_request=salt)
            for c in chunks]


def gpu_split(fleet: Fleet, prefill: int, chunk: int, policy: str = "kv-aware", salt: bool = False) -> ClusterConfig:
    """``prefill`` of the budget's devices prefill workers, the rest decode workers."""
    n = fleet.devices
    if not 1 <= prefill < n:
        raise ValueError(f"a split of {n} devices needs 1 to {n - 1} prefill workers, got {prefill}")
    spec = WorkerSpec(max_model_len=fleet.max_model_len, max_num_seqs=fleet.max_num_seqs, block_size=fleet.block_size,
                      num_blocks=fleet.num_blocks, max_num_batched_tokens=chunk)
    return ClusterConfig(name=f"split{prefill}p{n - prefill}d_chunk{chunk}", mode="disaggregated",
                         prefill=prefill, decode=n - prefill, prefill_spec=dataclasses.replace(spec, role="prefill"),
                         decode_spec=dataclasses.replace(spec, role="decode"), policy=policy,
                         store_memory_bytes=fleet.store_memory, salt_per_request=salt)


def split_starts(devices: int, centers: list[float]) -> list[int]:
    """The prefill workers the split search starts from (or, given ``--prefill-shares``, the
    only splits tried): each prefill share of ``centers`` of the budget, rounded."""
    if devices < 2:
        return []
    return sorted({min(max(round(c * devices), 1), devices - 1) for c in centers})


def next_splits(rows: list[dict[str, Any]], devices: int) -> list[int]:
    """The split search's next prefill counts, given the splits simulated so far: a hill climb
    on capacity per device, in steps of ``devices // 16`` (at least 1), then of 1, that ends when
    the best split's neighbours at step 1 are both known. Of equal capacities the split
    simulated first stays the best: the climb moves only on a strict gain."""
    caps = {r["prefill"]: r["capacity_per_device"] for r in rows if r["mode"] != "colocated"}
    if not caps:
        return []
    best = max(caps, key=caps.__getitem__)   # the first of equals, in the order simulated
    for step in sorted({max(devices // 16, 1), 1}, reverse=True):
        new = [q for q in (best - step, best + step) if 1 <= q < devices and q not in caps]
        if new:
            return new
    return []


def devices_of(c: ClusterConfig, gpu: bool) -> int:
    return c.workers if gpu else sum(s.threads for s in c.specs())
