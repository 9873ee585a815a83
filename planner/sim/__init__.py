"""The discrete-event simulator of the serving path (``kvplan simulate``).

``config`` (what runs), ``costs`` (step times from a profile), ``store``, ``worker`` (the
engine's own scheduler on a virtual clock), ``cluster`` (the event loop, the router's own
placement code, the client), ``run`` (points, unloaded probes, profiles per thread count).
"""
