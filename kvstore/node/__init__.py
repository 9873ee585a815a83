"""One store node in-process: the shared-memory arena, its allocator, the host/SSD/GPU tiers,
the tier policy and BlockStore. No sockets, no etcd."""
