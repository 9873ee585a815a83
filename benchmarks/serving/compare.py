"""The comparison: four serving configurations on one CPU budget, every workload, one run.

    python -m benchmarks.serving.compare --quick --out results/compare_quick     # 6.5 min on 2 CPUs
    python -m benchmarks.serving.compare --out results/compare                    # 45 min on 2 CPUs

Configurations (``CONFIGS``), each started with ``kvrouter up`` (CPU sets and threads printed
in the results), the same total KV memory (512 blocks of 16 tokens):

- ``colo_nochunk``: one colocated worker, 2 threads on CPUs 0-1, chunked prefill off
  (a prompt is prefilled whole, budget 2048 tokens);
- ``colo_chunk``: the same with chunked prefill, a 256-token step budget;
- ``disagg``: 1 prefill + 1 decode worker, 1 thread each, pinned to CPU 0 and CPU 1, 256
  blocks each; prefix reuse off: every request carries its own ``cache_salt`` (its id), so
  neither the store nor a device cache can give it a hit, while the prefill -> decode handoff
  still goes through the store; no trace pre-warm;
- ``disagg_store``: the same with the store's prefix cache (no salt).

The mixed workload is salted in every configuration: its prompts are random and share
nothing, but its quiet run repeats the very same short prompts, which a prefix cache would
otherwise serve from the run before.

The store daemon, etcd, the router and the load generator are not pinned: they share the
two CPUs with the workers. Colocated workers are attached to the store as ``kvrouter up``
runs them (device prefix cache + store); ``colo_chunk`` also runs the trace with per-request
salts (``colo_chunk_nosalt`` vs ``colo_chunk_salted`` in the results) to separate the split
from the cache.

Parts (each a ``benchmarks.serving.sweep`` run against the configuration's endpoint): ``mixed``
(with the huge prefills and without: the same short requests at the same times),
``trace`` (goodput vs rate), ``multi_turn`` (one rate), and on ``disagg_store`` ``long_hit``:
a 2032-token prompt cold, then again after other prompts pushed it out of both device
caches (a full store hit), then at once again (a device hit). Objectives are fixed per part
from the first configuration's unloaded latency (TTFT 5x, TPOT 2x) and reused for the rest;
on the trace, whose prompts run from 1 to ~1,700 tokens, the TTFT objective is 5x the
unloaded TTFT *at each request's prompt length* (a line through two probes: the window's
median and 90th-percentile prompts), so that a long prompt is not failed for being long.
Every router request is logged (``--request-log``); the log is cut per part to report store
hits, KV bytes per request and KV transfer time against TTFT. Writes ``OUT/compare.json``
(also printed as one line); ``benchmarks.serving.compare_report`` draws the PNGs and the tables.

Failing loudly: a configuration whose ``kvrouter up`` does not start (its port already taken,
its own "The router is up" line never printed, the launcher exited) is an ``error`` in the
results and nothing is measured on it; a part whose sweep fails is an ``error`` too. Any
error makes the exit status 1 (``compare.json`` still written). SIGTERM or SIGINT stop the
sweep and the cluster running at the time (``benchmarks.lifecycle``), write what was done
with ``"interrupted"``, and exit 128 + the signal number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from benchmarks import lifecycle
from benchmarks.lifecycle import Configuration, Launched, kvrouter_up
from benchmarks.report import emit, machine_info
from benchmarks.serving.load_client import ClientConfig, fetch_model, stream_completion
from planner.metrics import RequestResult
from planner.workloads import BenchRequest, TokenSpace

PY = sys.executable
CONFIGS: dict[str, dict[str, Any]] = {
    "colo_nochunk": {"up": "--mode colocated --threads-per-worker 2 --colocated-cpus 0,1 "
                           "--worker-arg=--num-blocks=512 --worker-arg=--no-chunked-prefill "
                           "--worker-arg=--max-num-batched-tokens=2048", "salt": False},
    "colo_chunk": {"up": "--mode colocated --threads-per-worker 2 --colocated-cpus 0,1 "
                         "--worker-arg=--num-blocks=512 --worker-arg=--max-num-batched-tokens=256",
                   "salt": False},
    "disagg": {"up": "--mode disaggregated --prefill 1 --decode 1 --threads-per-worker 1 "
                     "--prefill-cpus 0 --decode-cpus 1 --worker-arg=--num-blocks=256", "salt": True},
    "disagg_store": {"up": "--mode disaggregated --prefill 1 --decode 1 --threads-per-worker 1 "
                           "--prefill-cpus 0 --decode-cpus 1 --worker-arg=--num-blocks=256", "salt": False},
}
# Huge prompts of 1,200-2,000 tokens (within the 2,048-token context): a colocated stall of 3-4 s
# on these CPUs, about a short request's quiet life (~3 s); earlier runs used 1,024 tokens.
MIXED = ("--workload mixed --mixed-short-prompt 64 --mixed-short-output 32 --mixed-long-prompt 1600 "
         "--mixed-long-output 4 --mixed-long-share 0.2")
TRACE = "--workload trace --trace-count 60 --trace-scale 32 --ttft-slo-per-length"
CHAT = ("--workload multi_turn --chat-users 16 --chat-turns 4 --chat-first-message 128 "
        "--chat-message 32 --chat-reply 16 --chat-think-time-s 1")
LONG_PROMPT, LONG_OUTPUT = 2032, 2  # 127 full blocks; prompt + output within the 2048 context
TRACE_RATES = {True: "0.3", False: "0.1,0.2,0.3,0.4,0.5"}
SALTED_TRACE_RATES = {True: None, False: "0.1,0.3,0.5"}  # colo_chunk's no-reuse trace (none in quick)


def parts(quick: bool) -> list[tuple[str, str, str]]:
    """(part, sweep label, sweep flags) in run order; the label keys the objectives.

    Full: about 11 min a configuration on 2 CPUs (mixed and its quiet twin 90 s each, the
    trace at five rates x 75 s, multi-turn 70 s). Quick: mixed, quiet and one trace rate,
    25 s points, one unloaded sample: under 10 min for all four configurations."""
    if quick:
        q = "--point-seconds 25 --unloaded-samples 1"
        return [("mixed", "mixed", f"{MIXED} --rates 0.4 {q}"),
                ("mixed", "mixed_quiet", f"{MIXED} --no-mixed-include-long --rates 0.4 {q}"),
                ("trace", "trace", f"{TRACE} --rates {TRACE_RATES[True]} {q}")]
    return [("mixed", "mixed", f"{MIXED} --rates 0.4 --point-seconds 90"),
            ("mixed", "mixed_quiet", f"{MIXED} --no-mixed-include-long --rates 0.4 --point-seconds 90"),
            ("trace", "trace", f"{TRACE} --rates {TRACE_RATES[False]} --point-seconds 75"),
            ("multi_turn", "multi_turn", f"{CHAT} --rates 0.4 --point-seconds 70")]


def _lines(path: Path) -> int:
    return sum(1 for _ in open(path)) if path.exists() else 0


def run_sweep(name: str, url: str, label: str, flags: str, salt: bool, out: Path,
              slo: dict[str, float] | None) -> dict[str, Any]:
    argv = [PY, "-m", "benchmarks.serving.sweep", "--config", f"{name}={url}", "--out", str(out),
            "--no-progress", *flags.split()]
    if salt:
        argv.append("--salt-per-request")
        if "trace" in flags:
            argv += ["--trace-prewarm", "none"]
    if slo:
        argv += ["--ttft-slo-ms", f"{slo['ttft_s'] * 1e3:.3f}", "--tpot-slo-ms", f"{slo['tpot_s'] * 1e3:.3f}",
                 "--ttft-slo-per-token-ms", f"{slo.get('ttft_per_token_s', 0.0) * 1e3:.6f}",
                 "--ttft-slo-ref-tokens", str(slo.get("ref_prompt_tokens", 0))]
    print(f"[compare] {name} {label}: {' '.join(argv[3:])}", file=sys.stderr, flush=True)
    proc = lifecycle.run(argv)
    if proc.returncode != 0 or not proc.stdout.strip():
        return {"error": f"the sweep exited with {proc.returncode}: {proc.stderr[-1500:]}"}
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    rec["argv"] = " ".join(["python"] + argv[1:])
    return rec


async def long_hit(url: str, space: TokenSpace, seed: int = 7) -> dict[str, Any]:
    """TTFT of a 2032-token prompt: cold, then a full store hit, then a device hit."""
    model = await fetch_model(url)
    cfg = ClientConfig(url, model, progress=False, request_timeout_s=300)
    rng = np.random.default_rng([seed, 5])
    prompts = [space.random(rng, LONG_PROMPT) for _ in range(3)]
    order = [("cold", 0), ("evict", 1), ("evict", 2), ("store_hit", 0), ("device_hit", 0)]
    out: dict[str, Any] = {"prompt_tokens": LONG_PROMPT, "runs": []}
    async with aiohttp.ClientSession() as session:
        for i, (kind, which) in enumerate(order):
            req = BenchRequest(f"long-{kind}-{i}", prompts[which], LONG_OUTPUT)
            res = RequestResult(req.request_id, kind, LONG_PROMPT, LONG_OUTPUT)
            await stream_completion(session, cfg, req, res, time.perf_counter())
            out["runs"].append({"kind": kind, "ttft_s": res.ttft_s, "cached_tokens": res.cached_tokens,
                                "error": res.error, "at_unix": time.time()})
    ttft = {r["kind"]: r["ttft_s"] for r in out["runs"] if r["kind"] != "evict"}
    if ttft.get("cold") and ttft.get("store_hit"):
        out["store_hit_over_cold"] = ttft["store_hit"] / ttft["cold"]
        out["device_hit_over_cold"] = (ttft["device_hit"] or float("nan")) / ttft["cold"]
    if ttft.get("store_hit") and ttft.get("device_hit"):
        # The figure: what the store adds to a hit, against a memcpy of the bytes it
        # brings, timed here in the same run (the default model's 720 KiB a block).
        blocks = LONG_PROMPT // 16
        memcpy_s = memcpy_seconds(blocks * 30 * 2 * 16 * 3 * 64 * 4)
        out["store_minus_device_s"] = ttft["store_hit"] - ttft["device_hit"]
        out["memcpy_s"] = memcpy_s
        out["store_minus_device_over_memcpy"] = out["store_minus_device_s"] / memcpy_s
    return out


def memcpy_seconds(nbytes: int, rounds: int = 7) -> float:
    """The median time of copying ``nbytes`` between two touched buffers (NumPy, one thread)."""
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def probe_requests(flags: str) -> int:
    """Requests a sweep sends one at a time before its load (``measure_unloaded``): a warm-up,
    the samples, and as many long probes again for per-length objectives."""
    argv = flags.split()
    n = int(argv[argv.index("--unloaded-samples") + 1]) if "--unloaded-samples" in argv else 3
    return 1 + n + (n if "--ttft-slo-per-length" in argv else 0)


def _both(record: dict[str, Any], name: str) -> float:
    """A request log record's figure over all its phases: its prefill side's plus its decode side's."""
    return sum((record.get(side) or {}).get(name, 0) for side in ("prefill_stats", "decode_stats"))


def log_stats(records: list[dict[str, Any]], skip: int = 4) -> dict[str, Any]:
    """Store hits, KV bytes and KV transfer time vs TTFT over router request records.

    The first ``skip`` records are the sweep's unloaded probes (one warm-up + 3, sent one at
    a time before any load); records with one output token are trace pre-warm requests.
    Hit rates are the first phase's (prefill, or the colocated run): the decode phase's
    store loads are the handoff, not a hit."""
    ok = [r for r in records[skip:] if r.get("status") == "ok" and r.get("output_tokens", 0) > 1
          and "first_token" in r.get("timeline", {}) and r.get("phases")]
    if not ok:
        return {"records": 0}
    prompt = sum(r["prompt_tokens"] for r in ok)
    first = [r["phases"][0].get("stats") or {} for r in ok]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    stats: dict[str, Any] = {
        "records": len(ok),
        "store_hit_rate": sum(s.get("store_hit_tokens", 0) for s in first) / prompt,
        "device_hit_rate": sum(s.get("device_hit_tokens", 0) for s in first) / prompt,
        "router_ttft_p50_s": pct([r["timeline"]["first_token"] for r in ok], 50),
    }
    split = [r for r in ok if len(r.get("phases", [])) >= 2 and r["phases"][0]["phase"] == "prefill"]
    if split:
        moved = [_both(r, "kv_bytes_saved") + _both(r, "kv_bytes_loaded") for r in split]
        loaded = [_both(r, "kv_bytes_loaded") for r in split]
        save_s = [r["phases"][0]["stats"].get("store_save_s", 0.0) for r in split]
        load_s = [sum(p["stats"].get("store_load_s", 0.0) for p in r["phases"][1:] if p.get("stats")) for r in split]
        ttft = [r["timeline"]["first_token"] for r in split]
        stats.update({
            "split_records": len(split),
            "kv_bytes_p2d_p50": pct(loaded, 50), "kv_bytes_p2d_p95": pct(loaded, 95),
            "kv_bytes_moved_p50": pct(moved, 50), "kv_bytes_moved_p95": pct(moved, 95),
            "save_s_p50": pct(save_s, 50), "load_s_p50": pct(load_s, 50),
            "transfer_share_of_ttft_p50": pct([(a + b) / t for a, b, t in zip(save_s, load_s, ttft) if t > 0], 50),
            "transfer_share_of_ttft_p95": pct([(a + b) / t for a, b, t in zip(save_s, load_s, ttft) if t > 0], 95),
            "handoff_gap_p50_s": pct([r["timeline"]["decode_first"] - r["timeline"]["transfer_start"]
                                      for r in split if "decode_first" in r["timeline"]], 50),
        })
    return stats


def run_config(name: str, spec: dict[str, Any], port: int, out: Path, plan: list[tuple[str, str, str]],
               slos: dict[str, dict[str, float]], results: dict[str, Any], do_long: bool,
               quick: bool = False, model: str = "default", step_trace: bool = False) -> None:
    cdir = out / name
    cdir.mkdir(parents=True, exist_ok=True)
    reqlog = cdir / "router_requests.jsonl"
    command = kvrouter_up(model, port, cdir / "logs", "2G", spec["up"], request_log=reqlog,
                          # each worker's steps: OUT/NAME/steps-ROLE-PID.jsonl
                          step_trace_dir=cdir.resolve() if step_trace else None)
    res: dict[str, Any] = {"command": command.replace(PY, "python"), "salt_per_request": spec["salt"], "parts": {}}
    results[name] = res
    launched: Launched | None = None
    try:
        launched = Launched(Configuration(name, command=command), open(cdir / "up.log", "w"))
        launched.wait_ready(300)
        url = f"http://127.0.0.1:{port}"
        variants = [(spec["salt"], "")]
        for part, label, flags in plan:
            vs = [(True, "")] if part == "mixed" else variants  # mixed: no reuse from the run before
            if part == "trace" and name == "colo_chunk" and SALTED_TRACE_RATES[quick]:
                vs = vs + [(True, "_salted")]
            for salt, suffix in vs:
                key = label + suffix
                if suffix:
                    flags = " ".join(f if not prev.startswith("--rates") else SALTED_TRACE_RATES[quick]
                                     for prev, f in zip([""] + flags.split(), flags.split()))
                start = _lines(reqlog)
                rec = run_sweep(name, url, key, flags, salt, cdir / key, slos.get(part))
                recs = [json.loads(x) for x in open(reqlog).read().splitlines()[start:]] if reqlog.exists() else []
                rec["router_log"] = log_stats(recs, skip=probe_requests(flags))
                rec["router_log_lines"] = [start, start + len(recs)]
                cfg = rec.get("configs", {}).get(name)
                if cfg and part not in slos:
                    slos[part] = cfg["slo"]
                res["parts"][key] = rec
                print(f"[compare] {name} {key}: {json.dumps(_brief(rec, name))}", file=sys.stderr, flush=True)
        if do_long:
            start = _lines(reqlog)
            res["long_hit"] = asyncio.run(long_hit(url, TokenSpace()))
            recs = [json.loads(x) for x in open(reqlog).read().splitlines()[start:]]
            res["long_hit"]["router"] = [{"prefill_stats": r.get("prefill_stats"),
                                          "decode_stats": r.get("decode_stats"),
                                          "first_token": r["timeline"].get("first_token"),
                                          "phases": [(p["phase"], {k: p.get("stats", {}).get(k) for k in (
                                              "store_hit_tokens", "device_hit_tokens", "computed_prompt_tokens",
                                              "store_load_s", "prefill_s")}) for p in r.get("phases", [])]}
                                         for r in recs]
            print(f"[compare] {name} long_hit: {res['long_hit'].get('store_hit_over_cold')}", file=sys.stderr)
        res["up_log"] = [x for x in open(cdir / "up.log").read().splitlines() if "pinned" in x or "ready" in x]
    except (RuntimeError, OSError) as e:
        res["error"] = f"{type(e).__name__}: {e}"
        print(f"[compare] {name} failed, nothing measured: {res['error']}", file=sys.stderr, flush=True)
    finally:
        if launched is not None:
            launched.stop()
            launched.log.close()


def errors(results: dict[str, Any]) -> list[str]:
    """Every configuration or part that did not give a measurement, as ``name[/part]: error``."""
    out = []
    for name, res in results.items():
        if "error" in res:
            out.append(f"{name}: {res['error']}")
        out += [f"{name}/{part}: {rec['error']}" for part, rec in res.get("parts", {}).items() if "error" in rec]
    return out


def _brief(rec: dict[str, Any], name: str) -> dict[str, Any]:
    cfg = rec.get("configs", {}).get(name)
    if not cfg:
        return {"error": rec.get("error", rec.get("failed"))}
    return {"max_rate_90": cfg["max_rate_90"], "curve": [
        {k: (round(v, 4) if isinstance(v, float) else v) for k, v in p.items()
         if k in ("rate", "tpot_p99", "ttft_p50", "attainment", "goodput", "cached_fraction")} for p in cfg["curve"]]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.compare", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/compare", help="run directory (default %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="mixed + quiet + one trace rate at 25 s points (~6.5 min on 2 CPUs)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated configurations to run, in order (default %(default)s)")
    p.add_argument("--parts", default=None,
                   help="comma-separated (default: mixed,mixed_quiet,trace,multi_turn,long_hit; quick: the plan's)")
    p.add_argument("--model", default="default",
                   help="every configuration's checkpoint: 'default' (SmolLM2-135M) or a directory")
    p.add_argument("--port", type=int, default=8390, help="the router port of every configuration (default 8390)")
    p.add_argument("--point-seconds", type=float, default=None,
                   help="every part's point length in seconds (default: each part's own: 90, 75, 70; quick 25)")
    p.add_argument("--trace-rates", default=None,
                   help="the trace part's rates, comma-separated (default 0.1,...,0.5; quick 0.3)")
    p.add_argument("--mixed-extra", default="", help="extra sweep flags for the mixed parts, e.g. "
                   "'--mixed-long-share 0.3 --rates 0.3 --point-seconds 70'")
    p.add_argument("--part-flags", action="append", default=[], metavar="LABEL=FLAGS",
                   help="extra sweep flags for one part, after every other (later flags win); repeatable, "
                        "e.g. 'trace=--rates 0.1,0.15,0.2 --point-seconds 120'")
    p.add_argument("--step-trace", action="store_true",
                   help="every worker logs its steps to OUT/NAME/steps-ROLE-PID.jsonl (kvengine serve "
                        "--step-trace): the step times the simulator's are checked against")
    return p


def build_plan(args: argparse.Namespace) -> tuple[list[str], list[tuple[str, str, str]]]:
    """The parts this run has, and each one's (part, label, sweep flags) after the flags that
    change them: ``--mixed-extra``, ``--point-seconds``, ``--trace-rates``, then
    ``--part-flags`` (later flags win)."""
    wanted = (args.parts or ",".join([lbl for _, lbl, _ in parts(args.quick)]
                                     + ([] if args.quick else ["long_hit"]))).split(",")
    plan = [(part, label, f"{flags} {args.mixed_extra}".strip() if part == "mixed" else flags)  # later flags win
            for part, label, flags in parts(args.quick) if label in wanted]
    if args.point_seconds:
        plan = [(part, label, f"{flags} --point-seconds {args.point_seconds:g}") for part, label, flags in plan]
    if args.trace_rates:
        plan = [(part, label, f"{flags} --rates {args.trace_rates}" if part == "trace" else flags)
                for part, label, flags in plan]
    extra: dict[str, str] = {}
    for item in args.part_flags:
        label, sep, flags = item.partition("=")
        if not sep or label not in wanted:
            raise SystemExit(f"--part-flags takes LABEL=FLAGS for a part this run has ({','.join(wanted)}), "
                             f"got {item!r}")
        extra[label] = f"{extra.get(label, '')} {flags}".strip()
    plan = [(part, label, f"{flags} {extra[label]}" if label in extra else flags) for part, label, flags in plan]
    return wanted, plan


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted, plan = build_plan(args)
    results: dict[str, Any] = {}
    slos: dict[str, dict[str, float]] = {}
    t0 = time.time()
    interrupted = None
    try:
        for name in args.configs.split(","):
            run_config(name, CONFIGS[name], args.port, out, plan, slos, results,
                       do_long="long_hit" in wanted and name == "disagg_store", quick=args.quick,
                       model=args.model, step_trace=args.step_trace)
    except lifecycle.Interrupted as stop:   # run_config's finally stopped its cluster
        interrupted = stop
    record = {"bench": "compare", "quick": args.quick, "machine": machine_info(), "seconds": time.time() - t0,
              "slos": slos, "configs": results, "errors": errors(results),
              **({"interrupted": str(interrupted)} if interrupted else {})}
    emit(record, out / "compare.json")
    if interrupted:
        raise interrupted
    if record["errors"]:
        sys.exit("compare: " + "; ".join(e.splitlines()[0] for e in record["errors"]))


if __name__ == "__main__":
    sys.exit(lifecycle.run_main(main))
