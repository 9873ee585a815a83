"""The store as a native vLLM V1 KV connector (``kvstore.integrations.vllm.connector``).

``connector`` and ``metrics`` (its counters on vLLM's log and /metrics) are the modules that
import vLLM; ``scheduler`` (the scheduler side's lookups and per-step plans), ``transfers``
(the worker side's load and save threads), ``layout`` (where a block lies in the attention
backend's caches), ``specs`` (the plans and the keys), ``registration`` (the instance in etcd,
for the router) and ``serve`` (vLLM's server with the cluster secret as its API key) run
without it. Nothing else in the project imports this package.
"""
