"""clients/ladle/v1."""
