"""ladle.v1 results -> OpenAI (and vLLM) response bodies and stream chunks. Pure functions over the engine's
messages.

Chat and completions differ only in how a choice looks (`message` / `delta` vs `text`) and in the logprobs
layout; both are built here so the routers only choose which. Embeddings, scores and rerank results follow, in
OpenAI's and vLLM's shapes.
"""

from __future__ import annotations

import array
import base64
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gateway.schemas.chat import ChatFields
from gateway.schemas.completions import CompletionRequest
from gateway.schemas.pooling import RerankRequest
from ladle.v1 import engine_pb2, types_pb2

FINISH_REASONS = {
    types_pb2.FINISH_REASON_STOP: "stop",
    types_pb2.FINISH_REASON_LENGTH: "length",
    types_pb2.FINISH_REASON_ABORT: "abort",
    types_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


def finish_reason(value: types_pb2.FinishReason.ValueType) -> str | None:
    return FINISH_REASONS.get(value)


def usage(messages: Iterable[types_pb2.Usage]) -> dict[str, Any]:
    """OpenAI usage summed over one or more engine requests."""
    prompt = completion = cached = 0
    for u in messages:
        prompt += u.prompt_tokens
        completion += u.completion_tokens
        cached += u.cached_prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def response(
    object_name: str, response_id: str, model: str, choices: list[dict[str, Any]], usage_body: dict[str, Any]
) -> dict[str, Any]:
    """A whole response: `object_name` is "chat.completion" or "text_completion"."""
    return {
        "id": response_id,
        "object": object_name,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_body,
        "system_fingerprint": None,
    }


def chat_completion(
    body: ChatFields, reply: engine_pb2.GenerateResponse, response_id: str, model: str
) -> dict[str, Any]:
    """The whole `chat.completion` for one conversation's engine reply (the route and batch lines share it)."""
    choices = [chat_choice(c, c.index, body.logprobs) for c in reply.choices]
    return response("chat.completion", response_id, model, choices, usage([reply.usage]))


def text_completion(
    body: CompletionRequest, replies: Sequence[engine_pb2.GenerateResponse], response_id: str, model: str
) -> dict[str, Any]:
    """The whole `text_completion` for a completions body whose prompts got `replies`, in prompt order: choice
    `p * n + i` is prompt p's choice i, with the prompt echoed in front when `echo` is set."""
    prompts = body.prompts()
    want_logprobs = body.logprobs is not None
    choices = [
        completion_choice(c, p * body.n + c.index, want_logprobs, _echo(body, prompts[p]))
        for p, reply in enumerate(replies)
        for c in reply.choices
    ]
    return response("text_completion", response_id, model, choices, usage(r.usage for r in replies))


def _echo(body: CompletionRequest, prompt: str | list[int]) -> str:
    return prompt if body.echo and isinstance(prompt, str) else ""


def matched_stop(message: types_pb2.MatchedStop) -> str | int | None:
    kind = message.WhichOneof("kind")
    return None if kind is None else getattr(message, kind)


# -- chat ----------------------------------------------------------------------------------------------------


def tool_calls(calls: Sequence[types_pb2.ToolCall]) -> list[dict[str, Any]] | None:
    if not calls:
        return None
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}} for c in calls
    ]


def chat_logprobs(logprobs: Sequence[types_pb2.TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": list(lp.token_bytes),
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)} for t in lp.top_logprobs
                ],
            }
            for lp in logprobs
        ],
        "refusal": None,
    }


def chat_choice(choice: types_pb2.Choice, index: int, want_logprobs: bool) -> dict[str, Any]:
    """One finished choice as an OpenAI chat choice at position `index`."""
    calls = tool_calls(choice.tool_calls)
    message: dict[str, Any] = {"role": "assistant", "content": choice.text if (choice.text or not calls) else None}
    if calls:
        message["tool_calls"] = calls
    return {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(choice.logprobs) if want_logprobs else None,
        "finish_reason": finish_reason(choice.finish_reason),
        "stop_reason": matched_stop(choice.matched_stop),
    }



def chat_delta(delta: types_pb2.ChoiceDelta, want_logprobs: bool) -> dict[str, Any]:
    """The new content of one choice's stream delta as an OpenAI chat chunk choice (its finish reason, if any,
    goes in a chunk of its own: `finish_delta`)."""
    body: dict[str, Any] = {}
    if delta.text:
        body["content"] = delta.text
    if delta.tool_calls:
        body["tool_calls"] = [_tool_call_delta(t) for t in delta.tool_calls]
    return {
        "index": delta.index,
        "delta": body,
        "logprobs": chat_logprobs(delta.logprobs) if want_logprobs and delta.logprobs else None,
        "finish_reason": None,
    }


def has_content(delta: types_pb2.ChoiceDelta) -> bool:
    return bool(delta.text or delta.tool_calls or delta.logprobs)


def finish_delta(delta: types_pb2.ChoiceDelta, index: int, chat: bool) -> dict[str, Any]:
    """The chunk choice that ends a choice: no new content, only the finish reason (and vLLM's stop_reason)."""
    body: dict[str, Any] = {"index": index}
    if chat:
        body["delta"] = {}
    else:
        body["text"] = ""
    body["logprobs"] = None
    body["finish_reason"] = finish_reason(delta.finish_reason)
    body["stop_reason"] = matched_stop(delta.matched_stop)
    return body


def _tool_call_delta(delta: types_pb2.ToolCallDelta) -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": delta.arguments_json_delta}
    out: dict[str, Any] = {"index": delta.index, "function": function}
    if delta.id:
        out["id"] = delta.id
        out["type"] = "function"
    if delta.name:
        function["name"] = delta.name
    return out


def role_delta(index: int) -> dict[str, Any]:
    """The first chunk of each chat choice: the role, as OpenAI sends it."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


# -- completions ---------------------------------------------------------------------------------------------


def completion_logprobs(logprobs: Sequence[types_pb2.TokenLogprob], text_offset: int) -> dict[str, Any]:
    """The legacy completions layout: parallel lists, offsets into the choice's text."""
    offsets = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs} for lp in logprobs],
        "text_offset": offsets,
    }


def completion_choice(choice: types_pb2.Choice, index: int, want_logprobs: bool, echo: str = "") -> dict[str, Any]:
    return {
        "index": index,
        "text": echo + choice.text,
        "logprobs": completion_logprobs(choice.logprobs, len(echo)) if want_logprobs else None,
        "finish_reason": finish_reason(choice.finish_reason),
        "stop_reason": matched_stop(choice.matched_stop),
    }



def completion_delta(
    delta: types_pb2.ChoiceDelta, index: int, want_logprobs: bool, text_offset: int
) -> dict[str, Any]:
    return {
        "index": index,
        "text": delta.text,
        "logprobs": completion_logprobs(delta.logprobs, text_offset) if want_logprobs else None,
        "finish_reason": None,
    }


# -- pooling: embeddings, score, rerank ------------------------------------------------------------------------


def pooling_usage(messages: Iterable[types_pb2.Usage]) -> dict[str, int]:
    """Usage of pooling calls: prompt tokens only (nothing is generated)."""
    prompt = sum(u.prompt_tokens for u in messages)
    return {"prompt_tokens": prompt, "total_tokens": prompt}


def embedding_base64(values: Sequence[float]) -> str:
    """A vector as OpenAI's base64 encoding: its float32 values, little-endian, base64 (what the openai SDK
    decodes with `np.frombuffer(..., dtype="float32")`)."""
    packed = array.array("f", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def embedding_list(reply: engine_pb2.EmbedResponse, model: str, encoding_format: str) -> dict[str, Any]:
    """OpenAI's embeddings response (`object: list`), vectors as floats or base64 strings."""
    data = [
        {
            "object": "embedding",
            "index": e.index,
            "embedding": embedding_base64(e.values) if encoding_format == "base64" else list(e.values),
        }
        for e in reply.embeddings
    ]
    return {"object": "list", "data": data, "model": model, "usage": pooling_usage([reply.usage])}


def score_list(
    groups: Sequence[Sequence[int]], replies: Sequence[engine_pb2.ScoreResponse], response_id: str, model: str
) -> dict[str, Any]:
    """vLLM's score response: one entry per pair, in pair order. `replies[k]` answered the pairs `groups[k]`
    (`translate.to_engine.score_groups`), its scores in that order."""
    scores: dict[int, float] = {}
    for group, reply in zip(groups, replies, strict=True):
        scores.update(zip(group, reply.scores, strict=True))
    data = [{"index": i, "object": "score", "score": scores[i]} for i in range(len(scores))]
    usage_body = {**pooling_usage(r.usage for r in replies), "completion_tokens": 0}
    return {"id": response_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": usage_body}


def rerank_result(body: RerankRequest, reply: engine_pb2.ScoreResponse, response_id: str, model: str) -> dict[str, Any]:
    """vLLM's rerank response (Jina / Cohere compatible): documents by descending score (ties in document order),
    the first `top_n` of them (all when 0 or unset), each with its text unless return_documents is false."""
    texts = body.document_texts()
    order = sorted(range(len(reply.scores)), key=lambda i: -reply.scores[i])
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": reply.scores[i]}
        if body.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return {"id": response_id, "model": model, "usage": pooling_usage([reply.usage]), "results": results}


def pooling_param(param: str | None, names: Mapping[str, str]) -> str | None:
    """A field the engine named in a pooling call's error (e.g. `inputs[2]`), as the HTTP body names it (`input[2]`):
    its leading name replaced by `names` (kept when `names` has none)."""
    if param is None:
        return None
    head, sep, rest = param.partition("[")
    head, dot, tail = head.partition(".")
    renamed = names.get(head, head)
    return renamed + dot + tail + sep + rest
