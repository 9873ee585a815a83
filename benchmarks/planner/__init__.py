"""The planner's checks against the real thing, and what it is measured with.

    python -m benchmarks.planner.sim_fidelity     # kvplan's simulator against repeated compare runs
    python -m benchmarks.planner.recommend_check  # kvplan recommend on compare's workloads against the runs
    python -m benchmarks.planner.step_fidelity    # the simulator's step times against a worker's traced steps
    python -m benchmarks.planner.stack_profile    # what the serving stack adds: a profile's serving section
    python -m benchmarks.planner.steadiness       # how far this machine's speed moves (a simulator's floor)
    python -m benchmarks.planner.fleet_sim        # simulated GPU fleets on the Mooncake trace
    python -m benchmarks.planner.autoscale_bench  # decode-heavy then prefill-heavy: autoscaled vs static

They run on ``benchmarks.serving``'s runs and client (``compare``, ``sweep``, ``load_client``);
``autoscale_plot`` draws ``autoscale_bench``'s figure.
"""
