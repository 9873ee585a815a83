"""Tables and one PNG from a ``benchmarks.serving.compare`` run directory.

    python -m benchmarks.serving.compare_report results/compare --png docs/img/serving_compare.png \\
        --json docs/results/serving_compare.json

Reads ``OUT/compare.json`` and every ``OUT/CONFIG/PART/sweep.jsonl`` and prints Markdown
tables: the mixed workload's P99 TPOT of the short requests with and without the huge
prefills (their ratio is the interference), the trace's goodput and latency against rate with
the highest rate meeting both objectives for 90% of requests, store hits and TTFT on the
multi-turn and trace workloads, KV bytes per request and KV transfer time against TTFT from
the router's request log, and the 2k-token full-store-hit TTFT against a cold prefill. The
small JSON (``--json``) keeps those figures without the per-request data.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.report import pyplot, save_figure, write_json
from planner.metrics import SLO_SCALES, summary_stat


def _points(out: Path, config: str, part: str) -> list[dict[str, Any]]:
    path = out / config / part / "sweep.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


SCALES = (1.0, 2.0, 3.0)  # the table's columns; all of them are in SLO_SCALES


def _at_scales(out: Path, config: str, part: str, point: dict[str, Any]) -> list[float] | None:
    """Attainment with both objectives times each of ``SLO_SCALES``, from the point's requests."""
    from planner.metrics import RequestResult, Slo, attainment_at_scales

    path = out / config / part / "requests" / f"{config}_r{point['rate']:g}.jsonl"
    if not path.exists() or not point.get("slo"):
        return None
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    results = [RequestResult(**{k: v for k, v in r.items() if k != "tpot_s"}) for r in rows]
    return attainment_at_scales(results, Slo(**point["slo"]), SLO_SCALES)


def _paired(out: Path, config: str, rate: float) -> dict[str, Any] | None:
    """Each short request's TPOT with the huge prefills over its own TPOT without them (same
    id, prompt and send time in both runs): median and max of the ratio."""
    runs = []
    for part in ("mixed", "mixed_quiet"):
        path = out / config / part / "requests" / f"{config}_r{rate:g}.jsonl"
        if not path.exists():
            return None
        runs.append({r["request_id"]: r for r in map(json.loads, path.read_text().splitlines())
                     if r["tag"] == "short" and r.get("tpot_s")})
    ratios = sorted(runs[0][k]["tpot_s"] / runs[1][k]["tpot_s"] for k in runs[0].keys() & runs[1].keys())
    if not ratios:
        return None
    return {"pairs": len(ratios), "median": ratios[len(ratios) // 2], "max": ratios[-1]}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _router_log(out: Path, config: str, sweep: dict[str, Any]) -> dict[str, Any] | None:
    """The part's router-log figures, recomputed from its lines of the log when they are known."""
    lines = sweep.get("router_log_lines")
    path = out / config / "router_requests.jsonl"
    if not lines or not path.exists():
        return sweep.get("router_log")
    from benchmarks.serving.compare import log_stats

    recs = [json.loads(x) for x in path.read_text().splitlines()[lines[0]:lines[1]]]
    return log_stats(recs)


def collect(out: Path) -> dict[str, Any]:
    comp = json.loads((out / "compare.json").read_text())
    figures: dict[str, Any] = {"machine": comp["machine"], "quick": comp["quick"], "slos": comp["slos"],
                               "seconds": comp["seconds"], "configs": {}}
    for name, c in comp["configs"].items():
        f: dict[str, Any] = {"command": c["command"], "salt_per_request": c["salt_per_request"],
                             "placement": c.get("up_log", []), "error": c.get("error")}
        mixed, quiet = _points(out, name, "mixed"), _points(out, name, "mixed_quiet")
        if mixed and quiet:
            m, q = mixed[0], quiet[0]
            ms, qs = m["by_tag"].get("short", m["summary"]), q["by_tag"].get("short", q["summary"])
            f["mixed"] = {"rate": m["rate"], "short_tpot_p99_mixed_s": summary_stat(ms, "tpot_s", "p99"),
                          "short_tpot_p99_quiet_s": summary_stat(qs, "tpot_s", "p99"),
                          "short_itl_p99_mixed_s": summary_stat(ms, "itl_s", "p99"),
                          "short_itl_p99_quiet_s": summary_stat(qs, "itl_s", "p99"),
                          "short_ttft_p50_mixed_s": summary_stat(ms, "ttft_s", "p50"),
                          "long_ttft_p50_s": summary_stat(m["by_tag"].get("long"), "ttft_s", "p50"),
                          "short_requests": (ms.get("issued"), qs.get("issued")),
                          "long_requests": (m["by_tag"].get("long") or {}).get("issued", 0),
                          "attainment_mixed": m["summary"]["attainment"]}
            f["mixed"]["paired"] = _paired(out, name, m["rate"])
            a, b = f["mixed"]["short_tpot_p99_mixed_s"], f["mixed"]["short_tpot_p99_quiet_s"]
            f["mixed"]["interference"] = a / b if a and b else None
        for part in ("trace", "trace_salted", "multi_turn"):
            pts = _points(out, name, part)
            if not pts:
                continue
            sweep = c["parts"].get(part, {})
            at = [_at_scales(out, name, part, p) for p in pts]
            f[part] = {"max_rate_90": (sweep.get("configs", {}).get(name) or {}).get("max_rate_90"),
                       "router_log": _router_log(out, name, sweep),
                       "curve": [{"rate": p["rate"], "issued": p["summary"]["issued"],
                                  "goodput": p["summary"]["goodput"], "attainment": p["summary"]["attainment"],
                                  "ttft_p50_s": summary_stat(p["summary"], "ttft_s", "p50"),
                                  "ttft_p99_s": summary_stat(p["summary"], "ttft_s", "p99"),
                                  "tpot_p50_s": summary_stat(p["summary"], "tpot_s", "p50"),
                                  "tpot_p99_s": summary_stat(p["summary"], "tpot_s", "p99"),
                                  "attainment_at_1x_2x_3x": a and [a[SLO_SCALES.index(k)] for k in SCALES],
                                  "attainment_at_slo_scales": a,
                                  "prewarm": p.get("prewarm", {}).get("sent")} for p, a in zip(pts, at)]}
        if "long_hit" in c:
            f["long_hit"] = c["long_hit"]
        figures["configs"][name] = f
    return figures


def tables(fig: dict[str, Any]) -> str:
    cs = fig["configs"]
    lines = ["| workload | objectives TTFT / TPOT (ms) | TTFT per prompt token (ms) | at prompt tokens |",
             "| --- | --- | --- | --- |"]
    for part, slo in fig["slos"].items():
        lines.append(f"| {part} | {_ms(slo['ttft_s'])} / {_ms(slo['tpot_s'])} | "
                     f"{slo.get('ttft_per_token_s', 0) * 1e3:.3f} | {slo.get('ref_prompt_tokens', 0) or '-'} |")
    lines += ["", *targets(cs), ""]
    lines += ["| configuration | short P99 TPOT quiet (ms) | with huge prefills (ms) | interference | "
             "short P99 ITL quiet / mixed (ms) | long TTFT p50 (ms) | short / long requests | "
             "per-request TPOT ratio median / max |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n, f in cs.items():
        m = f.get("mixed")
        if m:
            ratio = "-" if m["interference"] is None else f"{m['interference']:.2f}x"
            lines.append(f"| {n} | {_ms(m['short_tpot_p99_quiet_s'])} | {_ms(m['short_tpot_p99_mixed_s'])} | {ratio} | "
                         f"{_ms(m['short_itl_p99_quiet_s'])} / {_ms(m['short_itl_p99_mixed_s'])} | "
                         f"{_ms(m['long_ttft_p50_s'])} | {m['short_requests'][1]} / {m['long_requests']} | "
                         + (f"{m['paired']['median']:.2f} / {m['paired']['max']:.2f}" if m.get("paired") else "-")
                         + " |")
    lines += ["", "| configuration | workload | rate (req/s) | sent | attainment | goodput (req/s) | "
              "TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | max rate at 90% | "
              "attainment at 1x / 2x / 3x the objectives |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for part in ("trace", "trace_salted", "multi_turn"):
        for n, f in cs.items():
            t = f.get(part)
            if not t:
                continue
            mr = (t["max_rate_90"] or {}).get("tested")
            for p in t["curve"]:
                lines.append(f"| {n} | {part} | {p['rate']:g} | {p['issued']} | {p['attainment']:.0%} | "
                             f"{p['goodput']:.3f} | {_ms(p['ttft_p50_s'])} / {_ms(p['ttft_p99_s'])} | "
                             f"{_ms(p['tpot_p50_s'])} / {_ms(p['tpot_p99_s'])} | {'-' if mr is None else mr} | "
                             + (" / ".join(f"{a:.0%}" for a in p["attainment_at_1x_2x_3x"])
                                if p["attainment_at_1x_2x_3x"] else "-")
                             + " |")
    lines += ["", "| configuration | workload | store hit rate | device hit rate | router TTFT p50 (ms) | "
              "P->D KV bytes p50 / p95 (KiB) | transfer / TTFT p50 / p95 | handoff to decode's first token p50 (ms) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for part in ("trace", "trace_salted", "multi_turn"):
        for n, f in cs.items():
            r = (f.get(part) or {}).get("router_log")
            if not r or not r.get("records"):
                continue
            kv = (f"{r['kv_bytes_p2d_p50'] / 1024:.0f} / {r['kv_bytes_p2d_p95'] / 1024:.0f}"
                  if r.get("split_records") else "-")
            share = (f"{r['transfer_share_of_ttft_p50']:.1%} / {r['transfer_share_of_ttft_p95']:.1%}"
                     if r.get("transfer_share_of_ttft_p50") is not None else "-")
            lines.append(f"| {n} | {part} | {r['store_hit_rate']:.1%} | {r['device_hit_rate']:.1%} | "
                         f"{_ms(r['router_ttft_p50_s'])} | {kv} | {share} | {_ms(r.get('handoff_gap_p50_s'))} |")
    for n, f in cs.items():
        lh = f.get("long_hit")
        if lh:
            lines += ["", f"2k-token prompt on {n}: " + ", ".join(
                f"{r['kind']} {_ms(r['ttft_s'])} ms" for r in lh["runs"])
                + (f"; store hit / cold = {lh['store_hit_over_cold']:.1%}" if "store_hit_over_cold" in lh else "")]
    return "\n".join(lines)


def targets(cs: dict[str, Any]) -> list[str]:
    """The three targets, as measured in this run."""
    out = []
    inter = {n: f["mixed"]["interference"] for n, f in cs.items() if f.get("mixed")}
    if inter:
        out.append("Interference (P99 TPOT with / without the huge prefills): "
                   + ", ".join(f"{n} {'-' if v is None else f'{v:.2f}x'}" for n, v in inter.items())
                   + " (targets: disaggregated <= 1.5x, colo_nochunk > 3x)")
    store, base = (cs.get("disagg_store") or {}).get("trace"), (cs.get("colo_chunk") or {}).get("trace")
    if store and base:
        by_rate = {p["rate"]: p["goodput"] for p in base["curve"]}
        ratios = [f"{p['rate']:g}: {p['goodput'] / by_rate[p['rate']]:.2f}x" if by_rate.get(p["rate"]) else
                  f"{p['rate']:g}: -" for p in store["curve"] if p["rate"] in by_rate]
        mr = [((t.get("max_rate_90") or {}).get("tested")) for t in (store, base)]
        out.append("Trace goodput disagg_store / colo_chunk by rate: " + ", ".join(ratios)
                   + f"; highest rate with 90% inside both objectives: {mr[0]} vs {mr[1]} (target >= 1.5x)")
    for n, f in cs.items():
        lh = f.get("long_hit") or {}
        if "store_hit_over_cold" in lh:
            out.append(f"Full store hit of a 2k prompt on {n}: TTFT {lh['store_hit_over_cold']:.1%} of cold "
                       "(target < 10%)")
    return out


def plot(fig_data: dict[str, Any], path: Path) -> None:
    """Mixed-workload interference; with the trace: goodput, attainment, TTFT and TPOT
    against rate (one curve per configuration) and attainment against the objectives' scale."""
    cs = fig_data["configs"]
    has_trace = any(f.get("trace") for f in cs.values())
    fig, axes = pyplot().subplots(2 if has_trace else 1, 3 if has_trace else 1,
                             figsize=(15, 8) if has_trace else (6, 4.2), squeeze=False)
    ax0 = axes[0][0]
    names = [n for n in cs if cs[n].get("mixed")]
    quiet = [cs[n]["mixed"]["short_tpot_p99_quiet_s"] * 1e3 for n in names]
    mixed = [cs[n]["mixed"]["short_tpot_p99_mixed_s"] * 1e3 for n in names]
    xs = range(len(names))
    ax0.bar([x - 0.2 for x in xs], quiet, 0.4, label="short requests alone")
    ax0.bar([x + 0.2 for x in xs], mixed, 0.4, label="with huge prefills")
    for x, q, m in zip(xs, quiet, mixed):
        ax0.text(x + 0.2, m, f"{m / q:.1f}x", ha="center", va="bottom", fontsize=8)
    ax0.set_xticks(list(xs), names, fontsize=8)
    ax0.set_ylabel("P99 TPOT of short requests (ms)")
    ax0.set_title(f"mixed workload at {cs[names[0]]['mixed']['rate']:g} req/s: interference" if names
                  else "mixed workload", fontsize=9)
    ax0.legend(fontsize=8)
    if has_trace:
        good, scale, att, ttft, tpot = axes[0][1], axes[0][2], axes[1][0], axes[1][1], axes[1][2]
        for i, (n, f) in enumerate(cs.items()):
            for part, style in (("trace", "o-"), ("trace_salted", "x:")):
                t = f.get(part)
                if not t:
                    continue
                c = t["curve"]
                rates = [p["rate"] for p in c]
                label = n + (" (salted)" if part == "trace_salted" else "")
                good.plot(rates, [p["goodput"] for p in c], style, color=f"C{i}", label=label)
                att.plot(rates, [100 * p["attainment"] for p in c], style, color=f"C{i}", label=label)
                for key, ax in (("ttft", ttft), ("tpot", tpot)):
                    ax.plot(rates, [(p[f"{key}_p50_s"] or float("nan")) * 1e3 for p in c], style,
                            color=f"C{i}", label=f"{label} p50")
                    ax.plot(rates, [(p[f"{key}_p99_s"] or float("nan")) * 1e3 for p in c], "--",
                            color=f"C{i}", alpha=0.6, label=f"{label} p99")
                mid = c[len(c) // 2]
                if part == "trace" and mid.get("attainment_at_slo_scales"):
                    scale.plot(SLO_SCALES, [100 * a for a in mid["attainment_at_slo_scales"]], style,
                               color=f"C{i}", label=f"{label} @ {mid['rate']:g} req/s")
        slo = fig_data["slos"].get("trace") or {}
        if slo.get("tpot_s"):
            tpot.axhline(slo["tpot_s"] * 1e3, color="grey", linestyle=":", label="TPOT objective")
        for ax in (att, scale):
            ax.axhline(90, color="grey", linestyle=":")
            ax.set_ylim(0, 102)
        good.set(ylabel="trace goodput (req/s meeting both objectives)", title="goodput against rate")
        att.set(ylabel="trace requests meeting both objectives (%)", title="attainment against rate")
        scale.set(xlabel="objectives x this scale", ylabel="requests meeting both (%)",
                  title="attainment against the objectives' scale")
        ttft.set(ylabel="trace TTFT (ms)", yscale="log", title="TTFT p50 (solid) and p99 (dashed)")
        tpot.set(ylabel="trace TPOT (ms)", yscale="log", title="TPOT p50 (solid) and p99 (dashed)")
        for ax in (good, att, ttft, tpot):
            ax.set_xlabel("request rate (req/s)")
        for ax in (good, scale, att, ttft, tpot):
            ax.grid(alpha=0.3)
            ax.title.set_fontsize(9)
            ax.legend(fontsize=6)
    m = fig_data["machine"]
    fig.suptitle(f"SmolLM2-135M fp32, {m['cpu_count']} CPUs ({m['processor']})"
                 + (", trace at 1/32 scale, TTFT objective per prompt length" if has_trace else ""), fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=80)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.compare_report", description=__doc__.split("\n")[0])
    p.add_argument("out", help="a benchmarks.serving.compare run directory (its --out)")
    p.add_argument("--png", default=None, help="also write the plot here")
    p.add_argument("--json", default=None, help="also write the figures, without per-request data, here")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    figures = collect(Path(args.out))
    print(tables(figures))
    if args.png:
        plot(figures, Path(args.png))
    if args.json:
        write_json(args.json, figures)


if __name__ == "__main__":
    main()
