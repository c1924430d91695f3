"""SGLang's native `POST /generate` (what SGLang's own examples and the RL rollout code written for it send): text or
token ids, one prompt or a batch, SGLang's `sampling_params`, logprobs, LoRA by `lora_path` (an adapter's name here),
whole or streamed as SGLang streams it (each event the choice's text and ids so far, then `data: [DONE]`). The
shapes are `translate.sglang`'s; every prompt is one engine request."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Depends

from gateway import calls, sse
from gateway.deps import CallId, HttpRequest, Metrics, Pool, Project, RequestTimer, admit, require_api_key
from gateway.deps import served_or_default as served_for
from gateway.json_output import FiniteJSONResponse
from gateway.schemas.sglang import SGLangGenerateRequest
from gateway.translate import sglang
from gateway.translate.cache_salt import project_cache_salt
from gateway.translate.to_engine import unicode_text
from ladle.v1 import engine_pb2, types_pb2

ROUTE = "/generate"
router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post(ROUTE, response_model=None, responses=sse.STREAMING_RESPONSES)
async def generate(
    body: SGLangGenerateRequest, pool: Pool, metrics: Metrics, rid: CallId, project: Project, http: HttpRequest
) -> Any:
    """One output (a single prompt, n 1) or the list of every prompt's choices; streamed, their events."""
    prompts = sglang.prompt_calls(body, rid)
    served = [served_for(pool, call.adapter) for call in prompts]
    caps = [call.sampling.max_new_tokens for call in prompts]
    cap = None if None in caps else sum((c or 0) * call.sampling.n for c, call in zip(caps, prompts, strict=True))
    admission = await admit(http, project, cap)
    salt = project_cache_salt(project)
    with unicode_text():  # (a lone surrogate in a prompt or a stop string: a 400, not protobuf's encode error)
        requests = [sglang.engine_request(call, f"{rid}-{i}", salt, model.adapter)
                    for i, (call, model) in enumerate(zip(prompts, served, strict=True))]  # fmt: skip
    timer = RequestTimer(metrics, ROUTE, project, served[0].id, admission)
    single = len(prompts) == 1 and prompts[0].sampling.n == 1 and not _is_batch(body)
    if body.stream:
        streams = await calls.started_all([calls.stream(pool, r) for r in requests])
        return sse.response(_events(prompts, calls.merge(streams), timer, single))
    replies = await calls.generate_all(pool, requests)
    timer.finish([reply.usage for reply in replies])
    latency = time.monotonic() - timer.started
    outputs = [
        sglang.output(call, sglang.whole_choice(choice), reply.usage, latency,
                      reply.prompt_logprobs if reply.HasField("prompt_logprobs") else None)
        for call, reply in zip(prompts, replies, strict=True) for choice in reply.choices
    ]  # fmt: skip
    return FiniteJSONResponse(outputs[0] if single else outputs)


def _is_batch(body: SGLangGenerateRequest) -> bool:
    if body.text is not None:
        return isinstance(body.text, list)
    return bool(body.input_ids) and isinstance((body.input_ids or [None])[0], list)


async def _events(
    prompts: Sequence[sglang.PromptCall], messages: AsyncIterator[tuple[int, engine_pb2.StreamResponse]],
    timer: RequestTimer, single: bool,
) -> AsyncIterator[dict[str, Any]]:
    """Each choice's output so far, after every engine message that advanced it (`index`: its place among every
    prompt's choices, where there are several)."""
    states: dict[tuple[int, int], sglang.ChoiceState] = {}
    first = [0]  # each prompt's first choice's place in the list
    for call in prompts:
        first.append(first[-1] + call.sampling.n)
    found: dict[int, types_pb2.PromptLogprobs] = {}
    used: dict[int, types_pb2.Usage] = {}
    try:
        async for place, message in messages:
            timer.token()
            used[place] = message.usage if message.HasField("usage") else message.usage_so_far
            if message.HasField("prompt_logprobs"):
                found[place] = message.prompt_logprobs
            call = prompts[place]
            for delta in message.choices:
                state = states.setdefault((place, delta.index), sglang.ChoiceState())
                state.add(delta.text, delta.token_ids, delta.logprobs)
                if delta.finish_reason:
                    matched = delta.matched_stop if delta.HasField("matched_stop") else None
                    state.finish = sglang.finish_reason(delta.finish_reason, matched, len(state.ids))
                event = sglang.output(call, state, used[place], time.monotonic() - timer.started, found.get(place))
                if not single:
                    event["index"] = first[place] + delta.index
                yield event
    finally:
        timer.finish(list(used.values()))
