"""What the simulator runs: a cluster configuration, as ``kvrouter up`` would start it.

:class:`ClusterConfig` is a fleet (``prefill`` + ``decode`` workers, or ``colocated`` ones), the
router's mode and prefill policy, each pool's engine settings (:class:`WorkerSpec`) and the
store's memory. :func:`from_up_flags` reads the flags a ``kvrouter up`` command line takes
(the ones ``benchmarks.serving.compare`` uses: ``--mode``, ``--prefill``, ``--decode``,
``--threads-per-worker``, ``--store-memory``, ``--policy``, ``--auto-threshold``,
``--balance-abs``, ``--balance-rel``, ``--autoscale`` with ``--max-workers``,
``--autoscale-interval`` and the router's ``--scale-*`` (``planner.sim.autoscale``; mode
``auto`` by default with it, as ``kvrouter up`` does), and the engine's own through
``--worker-arg=``: ``--num-blocks``, ``--max-num-batched-tokens``, ``--max-num-seqs``,
``--no-chunked-prefill``, ``--block-size``, ``--max-model-len``), and
:meth:`ClusterConfig.up_command` writes one back.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass, field, replace

from planner.sim.autoscale import SimAutoscale
from planner.sim.worker import WorkerSpec
from router.placement.balance import Balance
from router.scaling.policy import SCALING_FLAGS, ScalingConfig

__all__ = ["ClusterConfig", "from_up_flags", "parse_bytes"]

MODES = ("disaggregated", "colocated", "auto")


def parse_bytes(text: str) -> int:
    """``512M``, ``2G``, ``1048576`` -> bytes (binary units, as ``kvstore serve --memory``)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 512M, 2G)")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


@dataclass(frozen=True)
class ClusterConfig:
    """A fleet and its router (see the module docstring)."""

    name: str = "cluster"
    mode: str = "disaggregated"
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    prefill_spec: WorkerSpec = field(default_factory=lambda: WorkerSpec(role="prefill"))
    decode_spec: WorkerSpec = field(default_factory=lambda: WorkerSpec(role="decode"))
    colocated_spec: WorkerSpec = field(default_factory=lambda: WorkerSpec(role="colocated"))
    policy: str = "kv-aware"
    auto_threshold: int = 256
    balance: Balance = field(default_factory=Balance)  # colocated mode's load guard
    store_memory_bytes: int = 512 << 20
    salt_per_request: bool = False  # every request its own cache_salt: no prefix reuse
    # One client -> router -> worker (or back) message's latency; None: the profile's
    # serving hop (``StepCosts.hop_s``, 0 without a serving section).
    hop_s: float | None = None
    autoscale: SimAutoscale | None = None  # kvrouter up --autoscale (planner.sim.autoscale)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "colocated":
            if self.colocated < 1:
                raise ValueError("colocated mode needs at least one colocated worker")
        elif self.decode < 1 or (self.mode == "disaggregated" and self.prefill < 1) or self.prefill < 0:
            raise ValueError(f"{self.mode} mode needs a decode worker"
                             + (" and a prefill worker" if self.mode == "disaggregated" else ""))

    @property
    def workers(self) -> int:
        return self.colocated if self.mode == "colocated" else self.prefill + self.decode

    def spec_of(self, role: str) -> WorkerSpec:
        """The engine settings of a worker started (or changed) into ``role``."""
        return {"prefill": self.prefill_spec, "decode": self.decode_spec}.get(role, self.colocated_spec)

    def specs(self) -> list[WorkerSpec]:
        """One spec per worker, prefill workers first."""
        if self.mode == "colocated":
            return [self.colocated_spec] * self.colocated
        return [self.prefill_spec] * self.prefill + [self.decode_spec] * self.decode

    def label(self) -> str:
        if self.mode == "colocated":
            s = self.colocated_spec
            chunk = f"chunk {s.max_num_batched_tokens}" if s.enable_chunked_prefill else "no chunking"
            return f"colocated x{self.colocated} ({chunk})"
        if self.mode == "auto" and self.prefill == 0:
            label = f"colocated x{self.decode} (auto, no prefill pool)"
        else:
            label = f"{self.prefill}P:{self.decode}D" + (" auto" if self.mode == "auto" else "")
        if self.autoscale is not None:
            label += f", autoscaled within {self.autoscale.max_workers}"
        return label

    def up_command(self, model: str = "default", port: int = 8000, device: str | None = None) -> str:
        """The ``kvrouter up`` command that starts this configuration for real (a fleet of
        several colocated workers, which ``kvrouter up`` does not start: the ``kvengine serve``
        and ``kvrouter serve`` commands); ``device``: the workers' ``--device``."""
        d = WorkerSpec()
        if self.mode == "colocated" and self.colocated > 1:
            s = self.colocated_spec
            flags = [f"--num-blocks {s.num_blocks}", f"--max-num-batched-tokens {s.max_num_batched_tokens}"]
            if s.threads > 1:
                flags.append(f"--threads {s.threads}")
            if not s.enable_chunked_prefill:
                flags.append("--no-chunked-prefill")
            if s.block_size != d.block_size:
                flags.append(f"--block-size {s.block_size}")
            if s.max_num_seqs != d.max_num_seqs:
                flags.append(f"--max-num-seqs {s.max_num_seqs}")
            if s.max_model_len != d.max_model_len:
                flags.append(f"--max-model-len {s.max_model_len}")
            if device:
                flags.append(f"--device {device}")
            return (f"{self.colocated} x `kvengine serve --role colocated --model {model} --etcd URL "
                    f"{' '.join(flags)}`, then `kvrouter serve --mode colocated --etcd URL --policy {self.policy}"
                    f"{''.join(' ' + f for f in self._balance_flags())}`")
        argv = ["kvrouter", "up", "--model", model, "--port", str(port), "--mode", self.mode]
        spec = (self.colocated_spec if self.mode == "colocated"
                else self.prefill_spec if self.prefill else self.decode_spec)
        if self.mode != "colocated":
            argv += ["--prefill", str(self.prefill), "--decode", str(self.decode)]
        argv += ["--threads-per-worker", str(spec.threads), "--policy", self.policy,
                 "--store-memory", f"{self.store_memory_bytes >> 20}M"]
        if self.mode == "auto":
            argv += ["--auto-threshold", str(self.auto_threshold)]
        if self.mode == "colocated":
            argv += self._balance_flags()
        if self.autoscale is not None:
            a, dc = self.autoscale, ScalingConfig()
            argv += ["--autoscale", "--max-workers", str(a.max_workers), "--autoscale-interval", f"{a.interval_s:g}"]
            argv += [x for flag, name, _h in SCALING_FLAGS if getattr(a.scaling, name) != getattr(dc, name)
                     for x in (flag, f"{getattr(a.scaling, name):g}")]
        argv.append(f"--worker-arg=--num-blocks={spec.num_blocks}")
        if spec.block_size != d.block_size:
            argv.append(f"--worker-arg=--block-size={spec.block_size}")
        if spec.max_model_len != d.max_model_len:
            argv.append(f"--worker-arg=--max-model-len={spec.max_model_len}")
        if device:
            argv.append(f"--worker-arg=--device={device}")
        if spec.max_num_batched_tokens != d.max_num_batched_tokens:
            argv.append(f"--worker-arg=--max-num-batched-tokens={spec.max_num_batched_tokens}")
        if spec.max_num_seqs != d.max_num_seqs:
            argv.append(f"--worker-arg=--max-num-seqs={spec.max_num_seqs}")
        if not spec.enable_chunked_prefill:
            argv.append("--worker-arg=--no-chunked-prefill")
        if self.mode != "colocated" and self.decode_spec.save_all:
            argv.append("--worker-arg=--save-all")
        return shlex.join(argv)

    def _balance_flags(self) -> list[str]:
        d, b = Balance(), self.balance
        return ([f"--balance-abs={b.abs_requests}"] if b.abs_requests != d.abs_requests else []) + \
               ([f"--balance-rel={b.rel:g}"] if b.rel != d.rel else [])


def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--num-blocks", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--no-chunked-prefill", action="store_true")
    return p


def from_up_flags(name: str, flags: str, *, salt_per_request: bool = False,
                  max_model_len: int = 2048) -> ClusterConfig:
    """A configuration from ``kvrouter up`` flags (unknown ones, like CPU pinning, ignored)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--mode", default=None, choices=MODES)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--store-memory", default="512M")
    p.add_argument("--policy", default="kv-aware")
    p.add_argument("--auto-threshold", type=int, default=256)
    p.add_argument("--balance-abs", type=int, default=Balance().abs_requests)
    p.add_argument("--balance-rel", type=float, default=Balance().rel)
    p.add_argument("--worker-arg", action="append", default=[])
    p.add_argument("--autoscale", action="store_true")
    p.add_argument("--max-workers", type=int, default=None)
    p.add_argument("--autoscale-interval", type=float, default=2.0)
    for flag, field_name, _h in SCALING_FLAGS:
        p.add_argument(flag, type=float, default=None, dest=field_name)
    args, _ = p.parse_known_args(shlex.split(flags))
    args.mode = args.mode or ("auto" if args.autoscale else "disaggregated")
    autoscale = None
    if args.autoscale:
        scaling = ScalingConfig(**{f: getattr(args, f) for _flag, f, _h in SCALING_FLAGS
                                   if getattr(args, f) is not None})
        autoscale = SimAutoscale(scaling, args.max_workers or args.prefill + args.decode,
                                 args.autoscale_interval)
    w, _ = _worker_parser().parse_known_args(args.worker_arg)
    base = WorkerSpec(max_model_len=max_model_len, threads=args.threads_per_worker)
    changes = {k: v for k, v in (("num_blocks", w.num_blocks), ("block_size", w.block_size),
                                 ("max_num_batched_tokens", w.max_num_batched_tokens),
                                 ("max_num_seqs", w.max_num_seqs),
                                 ("max_model_len", w.max_model_len)) if v is not None}
    if w.no_chunked_prefill:
        changes["enable_chunked_prefill"] = False
    base = replace(base, **changes)
    colocated = args.mode == "colocated"
    return ClusterConfig(
        name=name, mode=args.mode, prefill=0 if colocated else args.prefill,
        decode=0 if colocated else args.decode, colocated=1 if colocated else 0,
        prefill_spec=replace(base, role="prefill"), decode_spec=replace(base, role="decode"),
        colocated_spec=replace(base, role="colocated"), policy=args.policy,
        auto_threshold=args.auto_threshold, balance=Balance(args.balance_abs, args.balance_rel),
        store_memory_bytes=parse_bytes(args.store_memory), salt_per_request=salt_per_request,
        autoscale=autoscale)
