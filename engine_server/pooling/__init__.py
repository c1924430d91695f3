"""Pooling: embeddings and scores from the final hidden states of prefill-only requests (`params`: what to pool
and how, per model and per request; `pooler`: the runner's side, vectors from the steps' hidden states)."""
