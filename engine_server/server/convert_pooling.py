"""Conversions between ladle.v1's pooling messages (Embed, Score) and the engine's own types, as pure functions.

Chat input to a pooling call is rendered without the assistant-turn header unless it asks for one: the vector
is of the conversation itself, as vLLM's chat embeddings default.
"""

from __future__ import annotations

import dataclasses

from engine_server.core.request import Priority
from engine_server.frontend import ChatPrompt, Prompt
from engine_server.pooling.requests import EmbedInput, EmbedResult, ScoreInput, ScoreResult
from engine_server.server.convert import cache_salt, chat_prompt, priority, prompt_from_input
from ladle.v1 import engine_pb2, types_pb2


def pooling_prompt(message: types_pb2.Input) -> Prompt:
    """Text, token ids or a ChatPrompt, as `convert.prompt_from_input`, but chat without the generation prompt
    unless `add_generation_prompt` is set."""
    if message.WhichOneof("kind") == "chat":
        prompt: ChatPrompt = chat_prompt(message.chat)
        if not message.chat.HasField("add_generation_prompt"):
            prompt = dataclasses.replace(prompt, add_generation_prompt=False)
        return prompt
    return prompt_from_input(message)


def embed_input(message: engine_pb2.EmbedRequest, default_priority: Priority) -> EmbedInput:
    """An Embed request (or a Batch item's) in the engine's vocabulary; ranges are checked when it runs."""
    return EmbedInput(
        request_id=message.request_id,
        prompts=[pooling_prompt(item) for item in message.inputs],
        normalize=message.normalize if message.HasField("normalize") else None,
        dimensions=message.dimensions if message.HasField("dimensions") else None,
        priority=priority(message.priority, default_priority),
        truncate_prompt_tokens=message.truncate_prompt_tokens or None,
        cache_salt=cache_salt(message.cache_salt),
    )


def score_input(message: engine_pb2.ScoreRequest, default_priority: Priority) -> ScoreInput:
    """A Score request (or a Batch item's) in the engine's vocabulary."""
    return ScoreInput(
        request_id=message.request_id,
        query=pooling_prompt(message.query),
        documents=[pooling_prompt(item) for item in message.documents],
        priority=priority(message.priority, default_priority),
        truncate_prompt_tokens=message.truncate_prompt_tokens or None,
        cache_salt=cache_salt(message.cache_salt),
    )


def embed_response(result: EmbedResult, model: str) -> engine_pb2.EmbedResponse:
    tokens = result.prompt_tokens
    return engine_pb2.EmbedResponse(
        request_id=result.request_id,
        embeddings=[
            engine_pb2.Embedding(index=i, values=vector.tolist(), num_tokens=count)
            for i, (vector, count) in enumerate(zip(result.vectors, result.num_tokens, strict=True))
        ],
        usage=types_pb2.Usage(prompt_tokens=tokens, total_tokens=tokens),
        model=model,
    )


def score_response(result: ScoreResult, model: str) -> engine_pb2.ScoreResponse:
    tokens = result.prompt_tokens
    return engine_pb2.ScoreResponse(
        request_id=result.request_id,
        scores=result.scores,
        usage=types_pb2.Usage(prompt_tokens=tokens, total_tokens=tokens),
        model=model,
    )
