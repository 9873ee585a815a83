"""The model over a paged KV cache: checkpoints, layers, attention (and its native kernel),
the cache tensor and ModelRunner. Torch; no HTTP, no etcd."""
