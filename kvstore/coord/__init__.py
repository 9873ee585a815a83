"""Coordination through etcd: the client, watches, the key layout, registration and membership."""
