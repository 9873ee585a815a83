"""Scaling: what each pool should scale on, and how many workers each pool should have.

- ``signals``: per-pool signals from the router's books (``pool_signals``): predicted TTFT
  from queued prompt tokens over the measured prefill rate, KV-cache utilization, ITL;
- ``policy``: the desired count per pool (``Planner``), a pure state machine with a
  hysteresis band, sustain times and a cool-down, driven by an injected clock;
- ``plan``: a layout within a worker budget and the actions that reach it (role changes
  first, then starts or stops), for ``kvrouter up --autoscale``;
- ``service.ScalingService``: the router's periodic evaluation, its gauges and its JSON
  report (``GET /admin/scaling``).

Everything but ``service`` is plain arithmetic with no I/O; the router's pool and metrics
are read, never changed. The recent windows the service reads (the inter-token latencies,
each pool's busy time) are ``router.metrics.RecentWindow`` s.
"""
