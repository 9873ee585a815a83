"""What engines call: the StoreClient protocol and connect() (api), Client (one node),
ClusterClient (rendezvous over etcd membership), AsyncClient, and the placement they share."""
