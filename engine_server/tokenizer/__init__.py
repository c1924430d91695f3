"""engine_server.tokenizer."""
