"""Other systems measured beside ours, and what drives them.

- ``mooncake_driver.py`` (``store.store_bench --peer mooncake``, ``lmcache_bench``'s Mooncake
  storage) and ``dynamo_driver.py`` (``serving.router_bench --peer dynamo``) run as files in
  those projects' own virtual environments (``setup_mooncake.sh``; ``pip install
  ai-dynamo-runtime``) and import nothing from this repository: the benchmark talks to them
  over stdin/stdout, one JSON object a line.
- ``nixl_peer``: NIXL's UCX backend, the one-sided peer of ``store_bench --hosts 2 --transport ucx``.
- ``lmcache_engine``: LMCache's own engine on CPU, as the LMCache tests and ``lmcache_bench``
  drive it.
- ``lmcache_bench``: LMCache's store/retrieve through our storage plugin against LMCache's
  ``lm://`` server and its Mooncake backend (``python -m benchmarks.peers.lmcache_bench``;
  its environment: ``setup_lmcache_peers.sh``).
"""
