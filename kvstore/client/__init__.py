"""What engines call: Client (one node), ClusterClient (rendezvous over etcd membership),
AsyncClient, and the placement they share."""
