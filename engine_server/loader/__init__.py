"""Model loading: resolve a model spec to a `ModelSource` (config, folder, streamed weights)."""

from __future__ import annotations

from engine_server.loader.dummy import DUMMY_PRESETS
from engine_server.loader.resolve import default_gguf_path, default_model_source, resolve_model
from engine_server.loader.source import ModelSource, default_cache_dir, write_float_checkpoint

__all__ = [
    "DUMMY_PRESETS",
    "ModelSource",
    "default_cache_dir",
    "default_gguf_path",
    "default_model_source",
    "resolve_model",
    "write_float_checkpoint",
]
