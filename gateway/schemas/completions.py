"""`POST /v1/completions` body."""

from __future__ import annotations

from typing import cast

from pydantic import Field

from gateway.schemas.common import UINT32_MAX, SamplingFields

# A prompt: one string, several strings, one token-id list, or several token-id lists (OpenAI's four forms).
Prompt = str | list[str] | list[int] | list[list[int]]
# Prompts in one request. Each is an engine call of its own, all started at once when streaming; far more than
# this (thousands) makes the engine's gRPC server shed calls at random, other callers' included.
MAX_PROMPTS = 512


class CompletionRequest(SamplingFields):
    prompt: Prompt
    # OpenAI's completions default. 0 (with echo, as vLLM takes it): the prompt alone, for its logprobs.
    max_tokens: int | None = Field(default=16, ge=0, le=UINT32_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of independent prompts (strings or token-id lists)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            return []
        if all(isinstance(p, int) for p in prompt):
            return [cast(list[int], list(prompt))]
        return cast(list[str | list[int]], list(prompt))
