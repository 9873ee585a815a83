"""Chaos: a cluster under load while its processes are killed, one kind at a time.

    python -m benchmarks.chaos.chaos_bench                        # one host
    python -m benchmarks.chaos.chaos_bench --hosts 3 --kills host-store   # across hosts (chaos_hosts)

``chaos_common`` holds what both use (``kvrouter up`` as a child, the router's request log,
the launcher's restart counts); ``chaos_plot`` draws the timeline of requests and kills.
"""
