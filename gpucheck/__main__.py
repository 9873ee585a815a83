"""``python -m gpucheck``: see ``gpucheck`` and ``cli.py``."""

from gpucheck.cli import main

raise SystemExit(main())
