"""Blocks between the store and an engine's paged cache: what every engine's connector shares
(our engine's ``engine.kv.connector`` and ``kvstore.integrations.vllm``). ``loader``: a batch
of store blocks, verified, into a cache; ``staging``: the pooled host buffers they move through.
"""
