"""The engine as a gRPC service: core thread (engine_loop), serving engine, conversions, servicer and server."""
