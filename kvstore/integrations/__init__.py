"""Adapters that make the store reachable from other engines' KV-cache seams.

Each module imports its engine's library only inside itself and nothing else in the project
imports them: ``lmcache_plugin`` (an LMCache storage plugin, ``pip install .[lmcache]``) and
``sglang_hicache`` (an SGLang HiCache storage backend). docs/integrations.md says how to load
them.
"""
