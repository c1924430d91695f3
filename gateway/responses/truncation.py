"""`truncation: "auto"`: the oldest turns of a conversation dropped until its prompt and output fit the context.

The gateway holds no tokenizer, so the prompt is measured by the engine (Tokenize renders the chat input with
the template, as a generation would). A conversation may only start at a user turn (after the system message,
which is always kept), so the candidates are the conversation cut before each of its user turns, oldest first;
the latest one that fits (fewest turns dropped) is found by bisection, in about log2(turns) Tokenize calls. If
even the last user turn alone does not fit, the request is sent as it is and the engine's 400 says why.
"""

from __future__ import annotations

from gateway import calls
from gateway.engines import EnginePool
from ladle.v1 import engine_pb2, types_pb2


async def fit_context(pool: EnginePool, request: engine_pb2.GenerateRequest) -> None:
    """Drop the oldest turns of `request`'s chat input, in place, until its prompt plus its max_tokens (or one
    token) fits the engine's context length; unchanged if it fits already or nothing can be dropped."""
    info = pool.model_info()
    if info is None or not info.context_length or request.input.WhichOneof("kind") != "chat":
        return
    budget = info.context_length - (request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 1)
    messages = list(request.input.chat.messages)
    system = 0
    while system < len(messages) and messages[system].role == "system":
        system += 1
    starts = [i for i in range(system, len(messages)) if messages[i].role == "user"]

    async def fits(start: int) -> bool:
        chat = types_pb2.ChatInput()
        chat.CopyFrom(request.input.chat)
        del chat.messages[:]
        chat.messages.extend(messages[:system] + messages[start:])
        reply = await calls.tokenize(pool, engine_pb2.TokenizeRequest(input=types_pb2.Input(chat=chat)))
        return len(reply.token_ids) <= budget

    if await fits(system):
        return
    candidates = [i for i in starts if i > system]  # more dropped, fewer tokens: `fits` is monotone here
    best = None
    low, high = 0, len(candidates) - 1
    while low <= high:
        middle = (low + high) // 2
        if await fits(candidates[middle]):
            best, high = middle, middle - 1
        else:
            low = middle + 1
    if best is None:
        return
    keep = messages[:system] + messages[candidates[best]:]
    del request.input.chat.messages[:]
    request.input.chat.messages.extend(keep)
