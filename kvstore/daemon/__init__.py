"""`kvstore serve | stats | bench`: the daemon's configuration, metrics and command line."""
