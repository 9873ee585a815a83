"""Benchmarks, one subpackage per subject; each prints one JSON line.

Every benchmark runs the same way, as a module from the repository root (``--help`` lists its
flags)::

  store: the store daemon and the engine's store path
    .venv/bin/python -m benchmarks.store.store_bench         # put/get throughput (--hosts 2: across hosts)
    .venv/bin/python -m benchmarks.store.store_conn_bench    # the daemon under 10,000 idle connections
    .venv/bin/python -m benchmarks.store.load_bench          # a store hit's load into the paged cache vs memcpy
    .venv/bin/python -m benchmarks.store.save_overlap_bench  # prefill with and without saving to the store
    .venv/bin/python -m benchmarks.store.handoff_bench       # the P->D handoff across hosts: one hop vs rendezvous
  serving: the load generator, the engine, the router, vLLM
    .venv/bin/python -m benchmarks.serving.serve_bench       # one serving run against an endpoint
    .venv/bin/python -m benchmarks.serving.sweep             # rates x configurations, with plots
    .venv/bin/python -m benchmarks.serving.compare           # the four serving configurations, one run
    .venv/bin/python -m benchmarks.serving.compare_report    # tables and a PNG from a compare run
    .venv/bin/python -m benchmarks.serving.engine_bench      # ModelRunner vs transformers
    .venv/bin/python -m benchmarks.serving.attention_bench   # native decode kernel vs torch
    .venv/bin/python -m benchmarks.serving.interference_bench  # running streams' ITL while prompts' KV loads
    .venv/bin/python -m benchmarks.serving.router_bench      # one routing decision vs index size
    .venv/bin/python -m benchmarks.serving.router_report     # router_bench's median of N runs and its verdict
    .venv/bin/python -m benchmarks.serving.vllm_bench        # vLLM's TTFT: cold, device hit, our connector's hits
    .venv/bin/python -m benchmarks.serving.vllm_routing      # our router vs vllm-router on the same vLLM instances
    .venv-vllm/bin/python -m benchmarks.serving.vllm_driver CONFIG  # one vLLM instance (vllm_bench, the vLLM tests)
  planner: the planner's checks against the real thing
    .venv/bin/python -m benchmarks.planner.sim_fidelity      # kvplan's simulator against repeated compare runs
    .venv/bin/python -m benchmarks.planner.recommend_check   # kvplan recommend on compare's workloads against the runs
    .venv/bin/python -m benchmarks.planner.step_fidelity     # the simulator's step times against a worker's traced
                                                             # steps
    .venv/bin/python -m benchmarks.planner.stack_profile     # what the serving stack adds: a profile's serving section
    .venv/bin/python -m benchmarks.planner.steadiness        # how far this machine's speed moves: one decode step,
                                                             # timed
    .venv/bin/python -m benchmarks.planner.fleet_sim         # simulated GPU fleets on the Mooncake trace (a simulation)
    .venv/bin/python -m benchmarks.planner.autoscale_bench   # decode-heavy then prefill-heavy: autoscaled vs static
  chaos
    .venv/bin/python -m benchmarks.chaos.chaos_bench         # a cluster under load while its processes are killed
  peers: other systems beside ours (their drivers and set-ups live there too)
    .venv/bin/python -m benchmarks.peers.lmcache_bench       # LMCache through our plugin vs its lm:// server and
                                                             # Mooncake

What they share: ``benchmarks.lifecycle`` (every process a benchmark starts, stopped however
the benchmark ends; a serving configuration launched and waited for) and ``benchmarks.report``
(the machine, the JSON line and file, the figures). The GPU check is not a benchmark: it is the
top-level ``gpucheck`` package (``scripts/gpu_check.sh``).
"""
