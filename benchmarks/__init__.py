"""Benchmarks; each prints one JSON line. The serving load generator's pieces:

    from planner.workloads import MixedSpec, TokenSpace
    from benchmarks.load_client import ClientConfig, run_workload
    from planner.metrics import Slo, summarize

    wl = MixedSpec(long_share=0.1).build(num_requests=100, rate=2.0, seed=0, space=TokenSpace())
    out = asyncio.run(run_workload(wl.requests, ClientConfig("http://127.0.0.1:8000", "model")))
    print(summarize(out.results, out.duration_s, Slo(ttft_s=0.5, tpot_s=0.05)))

Every benchmark runs the same way, as a module from the repository root (``--help`` lists its
flags)::

    .venv/bin/python -m benchmarks.store_bench      # the store daemon: put/get throughput
    .venv/bin/python -m benchmarks.store_conn_bench  # the store daemon under 10,000 idle connections
    .venv/bin/python -m benchmarks.load_bench       # a store hit's load into the paged cache vs memcpy
    .venv/bin/python -m benchmarks.router_bench     # one routing decision vs index size
    .venv/bin/python -m benchmarks.router_report    # router_bench's median of N runs and its verdict
    .venv/bin/python -m benchmarks.engine_bench     # ModelRunner vs transformers
    .venv/bin/python -m benchmarks.attention_bench  # native decode kernel vs torch
    .venv/bin/python -m benchmarks.save_overlap_bench  # prefill with and without saving to the store
    .venv/bin/python -m benchmarks.interference_bench  # running streams' ITL while prompts' KV loads: inline vs I/O threads
    .venv/bin/python -m benchmarks.serve_bench      # one serving run against an endpoint
    .venv/bin/python -m benchmarks.sweep            # rates x configurations, with plots
    .venv/bin/python -m benchmarks.compare          # the four serving configurations, one run
    .venv/bin/python -m benchmarks.compare_report   # tables and a PNG from a compare run
    .venv/bin/python -m benchmarks.autoscale_bench  # decode-heavy then prefill-heavy: autoscaled vs static layouts
    .venv/bin/python -m benchmarks.chaos_bench      # a cluster under load while its processes are killed
    .venv/bin/python -m benchmarks.handoff_bench    # the P->D handoff across hosts: one hop vs rendezvous
    .venv/bin/python -m benchmarks.lmcache_bench    # LMCache through our plugin vs its lm:// server and Mooncake
    .venv/bin/python -m benchmarks.vllm_bench       # vLLM's TTFT: cold, device hit, our connector's hits, ExampleConnector
    .venv/bin/python -m benchmarks.vllm_routing     # our router vs vllm-router (kv_aware) on the same vLLM instances
    .venv-vllm/bin/python -m benchmarks.vllm_driver CONFIG  # one vLLM instance the vLLM tests and vllm_bench drive
    .venv/bin/python -m benchmarks.sim_fidelity     # kvplan's simulator against repeated compare runs
    .venv/bin/python -m benchmarks.recommend_check  # kvplan recommend on compare's workloads against the runs
    .venv/bin/python -m benchmarks.step_fidelity    # the simulator's step times against a worker's traced steps
    .venv/bin/python -m benchmarks.stack_profile    # what the serving stack adds beside the engine: a profile's serving section
    .venv/bin/python -m benchmarks.steadiness       # how far this machine's speed moves: one decode step, timed over and over
    .venv/bin/python -m benchmarks.fleet_sim        # simulated GPU fleets on the Mooncake trace (a simulation)
"""
