"""Pure conversions between OpenAI JSON and the engine's ladle.v1 messages (one direction per module)."""
