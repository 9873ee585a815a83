"""The serving path's benchmarks: the load generator and its sweeps, the four serving
configurations compared, the engine and its decode kernel, running streams under KV loads,
the router's decision, and vLLM with our connector and behind our router.

The load generator's pieces (``planner`` holds the workloads and the metrics, shared with the
simulator)::

    from planner.workloads import MixedSpec, TokenSpace
    from benchmarks.serving.load_client import ClientConfig, run_workload
    from planner.metrics import Slo, summarize

    wl = MixedSpec(long_share=0.1).build(num_requests=100, rate=2.0, seed=0, space=TokenSpace())
    out = asyncio.run(run_workload(wl.requests, ClientConfig("http://127.0.0.1:8000", "model")))
    print(summarize(out.results, out.duration_s, Slo(ttft_s=0.5, tpot_s=0.05)))

``serve_bench`` is one run against an endpoint; ``sweep`` runs configurations over rates with
``serve_bench``'s pieces; ``compare`` runs ``sweep`` on the four configurations and
``compare_report`` draws its tables; ``router_report`` summarizes ``router_bench``;
``vllm_driver`` is one vLLM instance (run by ``.venv-vllm``'s Python) that ``vllm_bench`` and
the vLLM tests drive.
"""
