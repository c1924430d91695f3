"""The ladle engine: model loading, paged KV cache, scheduler, runner, sampler and the offline `LLM` API.

`from engine_server import LLM, SamplingParams` is the offline entry point; the names load lazily so that
light modules (config, errors) import without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_server.frontend import ChatPrompt
    from engine_server.llm import LLM
    from engine_server.sampling_params import SamplingParams

__all__ = ["LLM", "ChatPrompt", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine_server.llm import LLM

        return LLM
    if name == "SamplingParams":
        from engine_server.sampling_params import SamplingParams

        return SamplingParams
    if name == "ChatPrompt":
        from engine_server.frontend import ChatPrompt

        return ChatPrompt
    raise AttributeError(f"module 'engine_server' has no attribute {name!r}")
