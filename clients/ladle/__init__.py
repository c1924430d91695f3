"""clients/ladle."""
