"""The store's benchmarks: the daemon's put/get throughput (one host and between two), idle
connections, a store hit's load into the paged cache, saving beside prefill, the P->D handoff.

    python -m benchmarks.store.store_bench        # put/get throughput (--hosts 2: across hosts)
    python -m benchmarks.store.store_conn_bench   # the daemon under 10,000 idle connections
    python -m benchmarks.store.load_bench         # a store hit's load into the paged cache vs memcpy
    python -m benchmarks.store.save_overlap_bench # prefill with and without saving to the store
    python -m benchmarks.store.handoff_bench      # the P->D handoff across hosts: one hop vs rendezvous

``store_hosts`` is ``store_bench --hosts 2``'s part.
"""
