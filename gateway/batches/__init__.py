"""OpenAI batch *jobs* (`/v1/files`, `/v1/batches`): input lines and result lines (`lines`), running lines through
an engine's Batch RPC (`line_runner`), the durable worker that claims stored batches (`worker`, `results`) and
the API objects (`objects`).

Not `/v1/chat/completions/batch` (one HTTP call answered through one Batch RPC: `gateway.routers.batch_chat`), nor
the engine's Batch RPC itself (`gateway.calls`), nor the BATCH priority its items run at."""
