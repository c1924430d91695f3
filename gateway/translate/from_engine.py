"""ladle.v1 generation results -> OpenAI (and vLLM) chat and completions bodies and stream chunks. Pure functions
over the engine's messages.

Chat and completions differ only in how a choice looks (`message` / `delta` vs `text`) and in the logprobs
layout; both are built here so the routers only choose which. Embeddings, scores and rerank results are
`pooling_from_engine`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.schemas.chat import ChatFields
from gateway.schemas.common import SamplingFields
from gateway.schemas.completions import CompletionRequest
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
    prompt = completion = cached = reasoning = 0
    for u in messages:
        prompt += u.prompt_tokens
        completion += u.completion_tokens
        cached += u.cached_prompt_tokens
        reasoning += u.reasoning_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


def used(message: engine_pb2.StreamResponse) -> types_pb2.Usage:
    """What one engine stream has used as of `message`: its `usage` on the last message, else `usage_so_far` (all
    zeros from an engine that predates that field)."""
    return message.usage if message.HasField("usage") else message.usage_so_far


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
    body: ChatFields, reply: engine_pb2.GenerateResponse, response_id: str, model: str, echo: str = ""
) -> dict[str, Any]:
    """The whole `chat.completion` for one conversation's engine reply (the route and batch lines share it); `echo`
    (vLLM's: `ChatCompletionRequest.echoed`) goes before each choice's content."""
    as_ids = bool(body.return_tokens_as_token_ids)
    choices = [chat_choice(c, c.index, body.logprobs, one_call(body), as_ids) for c in reply.choices]
    if echo:
        for choice in choices:
            choice["message"]["content"] = echo + (choice["message"]["content"] or "")
    whole = response("chat.completion", response_id, model, choices, usage([reply.usage]))
    whole.update(prompt_extras(body, reply))  # the prompt's on the response, each choice's own ids on it
    for choice, engine_choice in zip(choices, reply.choices, strict=True):
        choice.update(generated_ids(body, engine_choice))
    return whole


def prompt_extras(body: SamplingFields, reply: engine_pb2.GenerateResponse) -> dict[str, Any]:
    """vLLM's fields of a prompt that `body` asks for: `prompt_logprobs` (`vllm_prompt_logprobs`) and, with
    `return_token_ids`, `prompt_token_ids`."""
    extras: dict[str, Any] = {}
    if body.prompt_logprobs is not None:
        extras["prompt_logprobs"] = vllm_prompt_logprobs(reply)
    if body.return_token_ids:
        extras["prompt_token_ids"] = list(reply.prompt_token_ids)
    return extras


def generated_ids(body: SamplingFields, choice: types_pb2.Choice) -> dict[str, Any]:
    """With vLLM's `return_token_ids`, a choice's generated ids (`token_ids`); else nothing."""
    return {"token_ids": list(choice.token_ids)} if body.return_token_ids else {}


def prompt_only(reply: engine_pb2.GenerateResponse) -> engine_pb2.GenerateResponse:
    """`reply` without its output, for a completions body with max_tokens 0 (the engine generated one token: each
    choice keeps no text, token or logprob, ends as `length`, and its tokens are not counted)."""
    stripped = engine_pb2.GenerateResponse()
    stripped.CopyFrom(reply)
    for choice in stripped.choices:
        choice.text, choice.reasoning_content = "", ""
        del choice.token_ids[:], choice.logprobs[:], choice.tool_calls[:]
        choice.finish_reason = types_pb2.FINISH_REASON_LENGTH
        choice.ClearField("matched_stop")
    stripped.usage.CopyFrom(input_only(stripped.usage))
    return stripped


def input_only(used: types_pb2.Usage) -> types_pb2.Usage:
    """`used` with no output tokens (a max_tokens 0 completion's: `prompt_only`)."""
    return types_pb2.Usage(prompt_tokens=used.prompt_tokens, total_tokens=used.prompt_tokens,
                           cached_prompt_tokens=used.cached_prompt_tokens)


def text_completion(
    body: CompletionRequest, replies: Sequence[engine_pb2.GenerateResponse], response_id: str, model: str
) -> dict[str, Any]:
    """The whole `text_completion` for a completions body whose prompts got `replies`, in prompt order: choice
    `p * n + i` is prompt p's choice i, with the prompt echoed in front when `echo` is set (and alone with
    max_tokens 0: `prompt_only`)."""
    if body.max_tokens == 0:
        replies = [prompt_only(reply) for reply in replies]
    prompts = body.prompts()
    want_logprobs = body.logprobs is not None
    choices = []
    for p, reply in enumerate(replies):
        echo = echoed(body, prompts[p], reply.prompt_logprobs if reply.HasField("prompt_logprobs") else None)
        for c in reply.choices:
            choice = completion_choice(c, p * body.n + c.index, want_logprobs, echo,
                                       bool(body.return_tokens_as_token_ids))
            choices.append({**choice, **prompt_extras(body, reply), **generated_ids(body, c)})  # each its prompt's
    return response("text_completion", response_id, model, choices, usage(r.usage for r in replies))


def vllm_prompt_logprobs(reply: engine_pb2.GenerateResponse) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a dict by token id of the token
    itself and its best alternatives, each `{"logprob", "rank", "decoded_token"}`; None without them."""
    if not reply.HasField("prompt_logprobs"):
        return None
    entries: list[dict[str, Any] | None] = [None]
    for lp in reply.prompt_logprobs.tokens:
        entry = {str(t.token_id): {"logprob": t.logprob, "rank": rank, "decoded_token": t.token}
                 for rank, t in enumerate(lp.top_logprobs, start=1)}
        entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.token}
        entries.append(entry)
    return entries


@dataclass(frozen=True)
class Echo:
    """A prompt echoed in front of a completion: its text, and with logprobs its tokens' entries of the legacy
    layout (`completion_logprobs`'s lists: the first token's logprob and alternatives are None)."""

    text: str = ""
    logprobs: dict[str, Any] | None = None


def echoed(body: CompletionRequest, prompt: str | list[int], found: types_pb2.PromptLogprobs | None) -> Echo:
    """What `body` echoes of `prompt`, given the engine's `found` prompt logprobs (asked for whenever echo needs
    them: with logprobs, or for a token-id prompt, whose text they carry). A text prompt is echoed as it was sent;
    offsets run over its tokens' texts (named by id in the lists with `return_tokens_as_token_ids`)."""
    if not body.echo:
        return Echo()
    if found is None:
        return Echo(prompt if isinstance(prompt, str) else "")
    texts = [found.first_token, *(lp.token for lp in found.tokens)]
    text = prompt if isinstance(prompt, str) else "".join(texts)
    if body.logprobs is None:
        return Echo(text)
    offsets, offset = [], 0
    for token in texts:
        offsets.append(offset)
        offset += len(token)
    as_ids = bool(body.return_tokens_as_token_ids)
    first = f"token_id:{found.first_token_id}" if as_ids else found.first_token
    return Echo(text, {
        "tokens": [first, *(token_label(lp, as_ids) for lp in found.tokens)],
        "token_logprobs": [None, *(lp.logprob for lp in found.tokens)],
        "top_logprobs": [None, *({token_label(t, as_ids): t.logprob for t in lp.top_logprobs} for lp in found.tokens)],
        "text_offset": offsets,
    })


def matched_stop(message: types_pb2.MatchedStop) -> str | int | None:
    kind = message.WhichOneof("kind")
    return None if kind is None else getattr(message, kind)


# -- chat ----------------------------------------------------------------------------------------------------


def one_call(body: ChatFields) -> bool:
    """Whether a choice answers with at most one tool call: `parallel_tool_calls` false, as OpenAI defines it. The
    model may still write several (in auto mode nothing stops it); the first is kept, as vLLM keeps it."""
    return body.parallel_tool_calls is False


def tool_calls(calls: Sequence[types_pb2.ToolCall]) -> list[dict[str, Any]] | None:
    if not calls:
        return None
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}} for c in calls
    ]


def token_label(token: types_pb2.TokenLogprob | types_pb2.TopLogprob, as_ids: bool) -> str:
    """A logprobs entry's token: its text, or with vLLM's `return_tokens_as_token_ids` "token_id:<id>"."""
    return f"token_id:{token.token_id}" if as_ids else token.token


def chat_logprobs(logprobs: Sequence[types_pb2.TokenLogprob], as_ids: bool = False) -> dict[str, Any]:
    """OpenAI's chat logprobs; `as_ids`: each token named by its id (`token_label`), its bytes still its text's."""
    return {
        "content": [
            {
                "token": token_label(lp, as_ids),
                "logprob": lp.logprob,
                "bytes": list(lp.token_bytes),
                "top_logprobs": [
                    {"token": token_label(t, as_ids), "logprob": t.logprob, "bytes": list(t.token_bytes)}
                    for t in lp.top_logprobs
                ],
            }
            for lp in logprobs
        ],
        "refusal": None,
    }


def chat_choice(
    choice: types_pb2.Choice, index: int, want_logprobs: bool, first_call_only: bool = False, as_ids: bool = False
) -> dict[str, Any]:
    """One finished choice as an OpenAI chat choice at position `index`; with `first_call_only` (`one_call`), its
    first tool call alone; `as_ids`: its logprobs' tokens by id (`token_label`)."""
    calls = tool_calls(choice.tool_calls[:1] if first_call_only else choice.tool_calls)
    answered = choice.text or not (calls or choice.reasoning_content)
    message: dict[str, Any] = {"role": "assistant", "content": choice.text if answered else None}
    if choice.reasoning_content:  # both names: clients read either (vLLM's `reasoning`, the older field)
        message["reasoning_content"] = message["reasoning"] = choice.reasoning_content
    if calls:
        message["tool_calls"] = calls
    return {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(choice.logprobs, as_ids) if want_logprobs else None,
        "finish_reason": finish_reason(choice.finish_reason),
        "stop_reason": matched_stop(choice.matched_stop),
    }



def chat_deltas(
    delta: types_pb2.ChoiceDelta, want_logprobs: bool, first_call_only: bool = False, as_ids: bool = False
) -> list[dict[str, Any]]:
    """The new content of one choice's stream delta as OpenAI chat chunk choices, one per chunk: the reasoning and
    content (with their logprobs), then each tool call delta on its own, as OpenAI streams calls (clients read
    `delta.tool_calls[0]` of each chunk); with `first_call_only` (`one_call`), the first call's deltas alone. Its
    finish reason, if any, goes in a chunk of its own: `finish_delta`."""
    body: dict[str, Any] = {}
    if delta.reasoning_content:
        body["reasoning_content"] = body["reasoning"] = delta.reasoning_content
    if delta.text:
        body["content"] = delta.text
    logprobs = chat_logprobs(delta.logprobs, as_ids) if want_logprobs and delta.logprobs else None
    bodies = [body] if body or logprobs else []
    bodies += [{"tool_calls": [_tool_call_delta(t)]} for t in delta.tool_calls if not first_call_only or t.index == 0]
    return [
        {"index": delta.index, "delta": b, "logprobs": logprobs if i == 0 else None, "finish_reason": None}
        for i, b in enumerate(bodies)
    ]


def has_content(delta: types_pb2.ChoiceDelta) -> bool:
    return bool(delta.text or delta.reasoning_content or delta.tool_calls or delta.logprobs)


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


def completion_logprobs(
    logprobs: Sequence[types_pb2.TokenLogprob], text_offset: int, as_ids: bool = False
) -> dict[str, Any]:
    """The legacy completions layout: parallel lists, offsets into the choice's text (its tokens' own text, whatever
    names them: `as_ids`, `token_label`)."""
    offsets = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {
        "tokens": [token_label(lp, as_ids) for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{token_label(t, as_ids): t.logprob for t in lp.top_logprobs} for lp in logprobs],
        "text_offset": offsets,
    }


def stream_echo(
    body: CompletionRequest, prompts: Sequence[str | list[int]]
) -> Callable[[int, engine_pb2.StreamResponse], Echo] | None:
    """What a streamed completion echoes of prompt p, from its engine stream's first message; None without echo."""
    if not body.echo:
        return None

    def echo(p: int, first: engine_pb2.StreamResponse) -> Echo:
        return echoed(body, prompts[p], first.prompt_logprobs if first.HasField("prompt_logprobs") else None)

    return echo


def completion_choice(
    choice: types_pb2.Choice, index: int, want_logprobs: bool, echo: Echo = Echo(), as_ids: bool = False
) -> dict[str, Any]:
    logprobs = completion_logprobs(choice.logprobs, len(echo.text), as_ids)
    return {
        "index": index,
        "text": echo.text + choice.text,
        "logprobs": _with_echo(echo, logprobs) if want_logprobs else None,
        "finish_reason": finish_reason(choice.finish_reason),
        "stop_reason": matched_stop(choice.matched_stop),
    }



def _with_echo(echo: Echo, logprobs: dict[str, Any]) -> dict[str, Any]:
    """The echoed prompt's entries, then `logprobs`' (the completion's, offsets already past the echo)."""
    if echo.logprobs is None:
        return logprobs
    return {key: [*echo.logprobs[key], *values] for key, values in logprobs.items()}


def completion_delta(
    delta: types_pb2.ChoiceDelta, index: int, want_logprobs: bool, text_offset: int, as_ids: bool = False
) -> dict[str, Any]:
    return {
        "index": index,
        "text": delta.text,
        "logprobs": completion_logprobs(delta.logprobs, text_offset, as_ids) if want_logprobs else None,
        "finish_reason": None,
    }
