"""engine_server."""
