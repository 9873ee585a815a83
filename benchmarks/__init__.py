"""Benchmarks; each prints one JSON line. The serving load generator's pieces:

    from benchmarks.workloads import MixedSpec, TokenSpace
    from benchmarks.load_client import ClientConfig, run_workload
    from benchmarks.metrics_calc import Slo, summarize

    wl = MixedSpec(long_share=0.1).build(num_requests=100, rate=2.0, seed=0, space=TokenSpace())
    out = asyncio.run(run_workload(wl.requests, ClientConfig("http://127.0.0.1:8000", "model")))
    print(summarize(out.results, out.duration_s, Slo(ttft_s=0.5, tpot_s=0.05)))

Command lines: ``python -m benchmarks.serve_bench`` (one run) and ``python -m benchmarks.sweep``
(rates x configurations, with plots).
"""
