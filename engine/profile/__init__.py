"""``kvengine profile``: measure this engine on this hardware into one profile file.

``format`` is the file's spec (dataclasses, JSON, fitted curves a simulator evaluates),
``measure`` runs the real model runner, connector and a loopback store daemon, ``plot``
draws each curve. The package imports only ``format`` eagerly (no torch at import).
"""

from engine.profile.format import SCHEMA_VERSION, Profile, load, save

__all__ = ["SCHEMA_VERSION", "Profile", "load", "save"]
