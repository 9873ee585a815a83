"""The worker fleet as the router sees it: the worker HTTP client and the etcd-fed pool."""
