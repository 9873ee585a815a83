"""`kvrouter up`: the local cluster launcher."""
