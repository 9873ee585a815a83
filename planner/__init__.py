"""The planner: workloads, a discrete-event simulator of the serving path, and ``kvplan``.

- ``planner.metrics``: per-request latencies and their summary (TTFT, TPOT, goodput), shared by
  the load generator and the simulator.
- ``planner.workloads``: seeded serving workloads (mixed, multi-turn, Mooncake-format traces),
  shared by the load generator (``benchmarks``) and the simulator.
- ``planner.sim``: the simulator. It runs the engine's own scheduler and block manager and the
  router's own placement policies against a clock, with step times from a ``kvengine profile``.
- ``planner.cli``: ``kvplan simulate`` / ``kvplan recommend``.
"""
