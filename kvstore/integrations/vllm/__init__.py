"""The store as a native vLLM V1 KV connector (``kvstore.integrations.vllm.connector``).

``connector`` is the only module that imports vLLM; ``scheduler`` (the scheduler side's
lookups and per-step plans), ``transfers`` (the worker side's load and save threads),
``layout`` (where a block lies in the attention backend's caches) and ``specs`` (the plans and
the keys) run without it. Nothing else in the project imports this package.
"""
