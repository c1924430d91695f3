"""OpenAI batch jobs: input lines and result lines (`lines`), running lines through an engine's Batch RPC
(`runner`), the durable worker that claims stored batches (`worker`, `results`) and the API objects (`objects`)."""
