"""``python -m benchmarks.gpu_check``: see ``benchmarks.gpu_check`` and ``cli.py``."""

from benchmarks.gpu_check.cli import main

raise SystemExit(main())
