"""Sizing from a profile and a workload alone, before any simulation: the seed's GPU-seconds,
the KV bytes a request moves, and what one GPU holds.

**GPU-seconds** (``gpu_seconds``), per request, on one device of the profile:

- *prefill*: the request's prompt prefilled alone, in chunks of ``chunk`` tokens
  (``StepCosts.prefill_s``), averaged over the workload's requests. Twice: with nothing cached
  (``prefill``), and with each prompt's longest run of whole blocks already seen in an earlier
  request of the workload cached (``prefill_reused``, what a cache that never forgets saves);
- *decode*: the request's output tokens, each a share of a decode step at the batch the decode
  pool can run: the largest batch ``b`` whose step over the mean decode context (prompt plus
  half the output) stays within the TPOT objective, fits ``max_num_seqs``, and fits the GPU's KV
  blocks; the request's share is ``output_tokens x step(b) / b``.

Per second of traffic at rate ``r``: ``r x`` those, the devices each pool keeps busy. Their
ratio is the prefill:decode split the work implies (``prefill_share`` = prefill / (prefill +
decode)); the simulation's best shape differs where queueing (the pool under the tighter
objective needs headroom), cache hits (less prefill than the no-reuse figure) or interference
(colocated chunked prefill runs decodes inside prefill passes) matter, and the recommendation
says which.

**KV bytes** (``kv_bytes``): a request's prompt KV (``prompt_tokens x kv_bytes_per_token``),
what a prefill worker hands a decode worker, at the workload's p50 and p95, and the time each
takes on a link of ``link_gbps`` gigabits per second.

**One GPU** (``gpu_blocks``): the KV blocks left in ``memory_gib`` at vLLM's default memory
utilization (0.9) after the weights (two bytes a parameter, the profile's model shape).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from engine.profile.format import ModelShape, Profile
from kvstore.keys import BlockKey, block_keys
from planner.sim.costs import StepCosts
from planner.workloads import Workload

__all__ = ["GpuSeconds", "KvBytes", "gpu_seconds", "kv_bytes", "gpu_blocks", "device_memory_gib",
           "weight_bytes", "reused_prefix_tokens"]

_NAMESPACE = BlockKey(bytes(16))   # one namespace: every request may share with every other
GPU_MEMORY_UTILIZATION = 0.9   # vLLM's default share of a GPU's memory for weights and KV


def weight_bytes(m: ModelShape) -> int:
    """The model's weights at two bytes a parameter (a Llama-family shape: attention, gated MLP,
    untied embedding and LM head)."""
    attn = m.hidden_size * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    mlp = 3 * m.hidden_size * m.intermediate_size
    return 2 * (m.num_layers * (attn + mlp) + 2 * m.vocab_size * m.hidden_size)


def device_memory_gib(p: Profile, default: float = 80.0) -> float:
    """The device's memory as its profile names it (``... 80GB ...``), else ``default``."""
    m = re.search(r"(\d+)\s*GB", p.hardware.device_name)
    return float(m.group(1)) if m else default


def gpu_blocks(p: Profile, block_size: int, memory_gib: float) -> int:
    """KV blocks of ``block_size`` tokens one GPU holds (module docstring)."""
    free = memory_gib * (1 << 30) * GPU_MEMORY_UTILIZATION - weight_bytes(p.model)
    blocks = int(free // (p.model.kv_bytes_per_token * block_size))
    if blocks < 1:
        raise ValueError(f"{p.model.name} does not fit {memory_gib:g} GiB with room for KV")
    return blocks


def reused_prefix_tokens(workload: Workload, block_size: int) -> list[int]:
    """Per request, the tokens of its longest run of whole leading blocks that an earlier request
    of the workload (pre-warm first) also began with."""
    seen: set[BlockKey] = set()
    out = []
    for i, r in enumerate([*workload.prewarm, *workload.requests]):
        keys = block_keys(_NAMESPACE, r.prompt, block_size)   # each key names its whole prefix
        hit = next((j for j, k in enumerate(keys) if k not in seen), len(keys))
        seen.update(keys)
        if i >= len(workload.prewarm):
            out.append(hit * block_size)
    return out


@dataclass(frozen=True)
class GpuSeconds:
    prefill: float              # device-seconds of prefill per request, nothing cached
    prefill_reused: float       # the same with each prompt's earlier-seen prefix cached
    decode: float               # device-seconds of decode per request
    decode_batch: int           # the decode batch that sets it
    decode_batch_bound: str     # what bounds that batch: tpot, max_num_seqs or kv_blocks
    mean_prompt_tokens: float
    mean_output_tokens: float

    @property
    def ratio(self) -> float:
        """Prefill over decode device-seconds: the P:D ratio the work implies."""
        return self.prefill / self.decode if self.decode > 0 else float("inf")

    @property
    def prefill_share(self) -> float:
        return self.prefill / (self.prefill + self.decode)

    @property
    def prefill_share_reused(self) -> float:
        """The prefill share counting the workload's prefix reuse."""
        return self.prefill_reused / (self.prefill_reused + self.decode)

    def per_second(self, rate: float) -> dict[str, float]:
        """Devices each pool keeps busy at ``rate`` requests per second."""
        return {"prefill": rate * self.prefill, "decode": rate * self.decode}

    def capacity_guess(self, devices: int) -> float:
        """The rate ``devices`` could serve with every device busy on its share of the work."""
        return devices / (self.prefill + self.decode)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "prefill_share": self.prefill_share,
                "prefill_share_reused": self.prefill_share_reused,
                "per_second_of_traffic": self.per_second(1.0)}


def gpu_seconds(costs: StepCosts, workload: Workload, chunk: int, tpot_s: float, max_num_seqs: int,
                kv_tokens_per_device: int) -> GpuSeconds:
    """The GPU-seconds of the module docstring."""
    reqs = workload.requests
    if not reqs:
        raise ValueError("no requests to size")
    reused = reused_prefix_tokens(workload, costs.block_size)
    prefill = statistics.fmean(costs.prefill_s(len(r.prompt), 0, chunk) for r in reqs)
    cached = [min(h, len(r.prompt) - 1) for r, h in zip(reqs, reused)]
    prefill_reused = statistics.fmean(costs.prefill_s(len(r.prompt) - c, c, chunk) for r, c in zip(reqs, cached))
    prompt = statistics.fmean(len(r.prompt) for r in reqs)
    output = statistics.fmean(r.max_tokens for r in reqs)
    context = prompt + output / 2
    by_kv = max(1, int(kv_tokens_per_device // max(context, 1)))
    batch, bound = min(max_num_seqs, by_kv), ("max_num_seqs" if max_num_seqs <= by_kv else "kv_blocks")
    while batch > 1 and costs.decode_s(batch, context) > tpot_s:
        batch, bound = batch - 1, "tpot"
    decode = output * costs.decode_s(batch, context) / batch
    return GpuSeconds(prefill, prefill_reused, decode, batch, bound, prompt, output)


@dataclass(frozen=True)
class KvBytes:
    p50: float
    p95: float
    link_gbps: float

    @property
    def transfer_s(self) -> dict[str, float]:
        per_s = self.link_gbps * 1e9 / 8
        return {"p50": self.p50 / per_s, "p95": self.p95 / per_s}

    def to_json(self) -> dict[str, Any]:
        return {"p50": self.p50, "p95": self.p95, "link_gbps": self.link_gbps, "transfer_s": self.transfer_s}


def kv_bytes(workload: Workload, kv_bytes_per_token: int, link_gbps: float) -> KvBytes:
    """A request's prompt KV at p50 and p95 (module docstring)."""
    if link_gbps <= 0:
        raise ValueError(f"the link's speed must be positive, got {link_gbps} Gb/s")
    sizes = np.asarray([len(r.prompt) * kv_bytes_per_token for r in workload.requests], dtype=np.float64)
    p50, p95 = np.percentile(sizes, [50, 95])
    return KvBytes(float(p50), float(p95), link_gbps)
