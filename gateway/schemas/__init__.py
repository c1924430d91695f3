"""OpenAI request bodies as pydantic models: what the gateway accepts, with OpenAI's ranges and defaults."""
