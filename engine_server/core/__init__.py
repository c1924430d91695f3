"""engine_server.core."""
