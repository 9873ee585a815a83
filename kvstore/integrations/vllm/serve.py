"""``python -m kvstore.integrations.vllm.serve [vLLM server flags]``: vLLM's OpenAI server with
the cluster secret as its API key, read from the cluster's secret file.

vLLM takes its API key from ``--api-key`` or ``$VLLM_API_KEY``; the cluster hands its children
the secret as a file path (``$KVCACHE_CLUSTER_SECRET_FILE``, ``kvstore.secret``), never the
secret on a command line. This sets ``$VLLM_API_KEY`` from that file (or from
``$KVCACHE_CLUSTER_SECRET``) when it is not set already, then runs
``vllm.entrypoints.openai.api_server`` in this process with the flags given: every route but
``/health`` and ``/metrics`` then wants ``Authorization: Bearer <secret>``, as our workers do.
"""

from __future__ import annotations

import os
import runpy
import sys

from kvstore import secret as cluster_secret


def main() -> None:
    if not os.environ.get("VLLM_API_KEY"):
        token = None
        path = os.environ.get(cluster_secret.ENV_FILE)
        if path:
            with open(path) as f:
                token = f.read().strip()
        token = token or os.environ.get(cluster_secret.ENV)
        if token:
            os.environ["VLLM_API_KEY"] = token
    sys.argv = ["vllm.entrypoints.openai.api_server", *sys.argv[1:]]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
