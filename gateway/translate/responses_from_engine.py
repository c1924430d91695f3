"""ladle.v1 generation results -> OpenAI Response objects and their output items. Pure functions.

A Response is made in two steps: `response_shell` at creation (the request's settings echoed, no output yet: what
`response.created` and a queued background response show), then `finished` over the engine's reply, or `failed`
and `cancelled`. Output items follow the choice: a `reasoning` item for the model's reasoning, a `message` with
one `output_text` part for its answer, then one `function_call` item per tool call. The streaming events
(`gateway.responses.events`) build the same items with `message_item` / `reasoning_item` / `function_call_item`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from gateway.schemas.responses import ResponsesRequest
from gateway.translate.responses_to_engine import new_item_id
from ladle.v1 import engine_pb2, types_pb2

INCOMPLETE_REASONS = {types_pb2.FINISH_REASON_LENGTH: "max_output_tokens"}


def response_shell(
    body: ResponsesRequest, response_id: str, model: str, status: str, created_at: int | None = None,
    conversation_id: str | None = None,
) -> dict[str, Any]:
    """The Response as created: the request's settings, `status` (queued or in_progress), no output yet; in the
    stored conversation `conversation_id`, if any."""
    fmt = body.text.format if body.text and body.text.format else None
    text: dict[str, Any] = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}
    reasoning = body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None}
    return {
        "id": response_id, "object": "response", "created_at": created_at or int(time.time()), "status": status,
        "background": body.background, "error": None, "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": model,
        "output": [], "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "reasoning": reasoning, "store": body.store,
        "temperature": body.temperature, "text": text,
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": body.tools or [], "top_logprobs": body.top_logprobs, "top_p": body.top_p,
        "truncation": body.truncation or "disabled", "usage": None, "user": body.user,
        "metadata": body.metadata or {},
        "conversation": {"id": conversation_id} if conversation_id else None,
    }


def usage(u: types_pb2.Usage) -> dict[str, Any]:
    """The Responses API's usage of one engine request."""
    return {
        "input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
        "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def logprobs(values: Sequence[types_pb2.TokenLogprob]) -> list[dict[str, Any]]:
    return [
        {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token_bytes),
         "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)}
                          for t in lp.top_logprobs]}
        for lp in values
    ]


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def output_text_part(text: str, token_logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if token_logprobs is not None:
        part["logprobs"] = token_logprobs
    return part


def message_item(item_id: str, parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": parts}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(choice: types_pb2.Choice, want_logprobs: bool, first_call_only: bool = False) -> list[dict[str, Any]]:
    """The output items of one finished choice: reasoning, then the answer, then the tool calls (with
    `first_call_only`, `parallel_tool_calls` false, the first alone)."""
    status = "incomplete" if choice.finish_reason in INCOMPLETE_REASONS else "completed"
    items = []
    if choice.reasoning_content:
        items.append(reasoning_item(new_item_id("reasoning"), choice.reasoning_content, status))
    if choice.text or not (choice.tool_calls or choice.reasoning_content):
        part = output_text_part(choice.text, logprobs(choice.logprobs) if want_logprobs else None)
        items.append(message_item(new_item_id("message"), [part], status))
    items += [function_call_item(new_item_id("function_call"), c.id, c.name, c.arguments_json, status)
              for c in (choice.tool_calls[:1] if first_call_only else choice.tool_calls)]
    return items


def finished(shell: dict[str, Any], output: list[dict[str, Any]], finish: types_pb2.FinishReason.ValueType,
             engine_usage: types_pb2.Usage) -> dict[str, Any]:
    """The Response once the engine is done: `output` items, the status the finish reason gives (`incomplete`
    with its reason when the output was cut at max_output_tokens), usage."""
    response = dict(shell, output=output, usage=usage(engine_usage), completed_at=int(time.time()))
    if finish == types_pb2.FINISH_REASON_ABORT:
        return dict(response, status="failed",
                    error={"code": "server_error", "message": "the engine aborted the request"})
    reason = INCOMPLETE_REASONS.get(finish)
    if reason is not None:
        return dict(response, status="incomplete", incomplete_details={"reason": reason})
    return dict(response, status="completed")


def from_reply(shell: dict[str, Any], reply: engine_pb2.GenerateResponse, want_logprobs: bool) -> dict[str, Any]:
    """`finished` over a whole (non-streamed) engine reply; a Responses request always has one choice."""
    choice = reply.choices[0]
    items = output_items(choice, want_logprobs, first_call_only=not shell["parallel_tool_calls"])
    return finished(shell, items, choice.finish_reason, reply.usage)


def failed(shell: dict[str, Any], code: str, message: str) -> dict[str, Any]:
    return dict(shell, status="failed", error={"code": code, "message": message})


def cancelled(shell: dict[str, Any]) -> dict[str, Any]:
    return dict(shell, status="cancelled")
