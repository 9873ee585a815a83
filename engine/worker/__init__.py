"""`kvengine serve`: the engine thread beside the HTTP server, its config, event stream and metrics."""
