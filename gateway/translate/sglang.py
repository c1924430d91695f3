"""SGLang's native `/generate` (`schemas.sglang`) into engine requests, and the engine's replies into SGLang's
outputs: `{"text", "output_ids", "meta_info"}` per choice, `meta_info` holding `id`, `finish_reason` (SGLang's
`{"type": "stop", "matched": <token id or string>}`, `{"type": "length", "length": n}` or `{"type": "abort"}`; None
while a stream runs), `prompt_tokens`, `completion_tokens`, `cached_tokens`, `e2e_latency` (seconds) and, with
`return_logprob`, `output_token_logprobs` / `output_top_logprobs` (and `input_token_logprobs` /
`input_top_logprobs` from `logprob_start_len` when it is 0 or more), each entry SGLang's `[logprob, token_id, text]`
(text None unless `return_text_in_logprobs`; the first prompt token's logprob None).

A single prompt with n 1 is answered as one output; a batch, or n over 1, as the list of every prompt's choices
(prompt after prompt). Streamed, each event is one choice's output so far (its text and ids whole, as SGLang sends
them by default), with its place in that list as `index` where there are several.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pydantic

from gateway.errors import invalid, invalid_body
from gateway.schemas.sglang import SGLangGenerateRequest, SGLangSampling
from gateway.translate.to_engine import ENGINE_SEEDS, prompt_input, refuse_unserved
from ladle.v1 import engine_pb2, types_pb2

UNSERVED_REQUEST = {  # SGLang's request fields ladle does not serve, and why
    "input_embeds": "send text or input_ids",
    "image_data": "send images through /v1/chat/completions",
    "audio_data": "send audio through /v1/chat/completions or /v1/audio/transcriptions",
    "video_data": "ladle reads no video",
    "custom_logit_processor": "ladle runs no caller-supplied code",
    "return_hidden_states": "ladle returns no hidden states",
    "session_params": "ladle keeps no sessions; send the whole prompt",
    "token_ids_logprob": "ask top_logprobs_num instead",
}
UNSERVED_SAMPLING = {
    "structural_tag": "use json_schema, regex or ebnf",
    "custom_params": "ladle runs no custom logit processors",
}
MAX_LOGPROBS = 20  # the engine's top_logprobs and prompt_logprobs cap


@dataclass(frozen=True)
class PromptCall:
    """One prompt of a `/generate` call with everything that applies to it."""

    prompt: str | list[int]
    sampling: SGLangSampling
    rid: str
    logprobs: bool = False
    top_logprobs: int = 0
    logprob_start: int = -1  # the first prompt position whose logprobs are answered; -1: none
    text_in_logprobs: bool = False
    adapter: str | None = None


def prompt_calls(body: SGLangGenerateRequest, call_id: str) -> list[PromptCall]:
    """The call's prompts, each with its own sampling and logprob options (a list field gives one per prompt, a single
    value applies to all); 400 for what SGLang refuses (neither or both of text and input_ids, lists of the wrong
    length, an unknown or bad sampling key) and for what ladle does not serve, naming the field."""
    refuse_unserved(body, UNSERVED_REQUEST)
    if (body.text is None) == (body.input_ids is None):
        raise invalid("send exactly one of text and input_ids", "text")
    prompts: list[str | list[int]]
    if body.text is not None:
        batch = isinstance(body.text, list)
        prompts = list(body.text) if isinstance(body.text, list) else [body.text]
    else:
        ids = body.input_ids or []
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = [list(p) for p in ids] if batch else [list(ids)]  # type: ignore[arg-type]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise invalid("prompts must not be empty", "input_ids" if body.text is None else "text")
    count = len(prompts)

    def each(value: Any, name: str) -> list[Any]:
        if isinstance(value, list):
            if not batch or len(value) != count:
                raise invalid(f"{name} must be one value, or one per prompt ({count})", name)
            return list(value)
        return [value] * count

    samplings = [_sampling(s or {}) for s in each(body.sampling_params, "sampling_params")]
    if isinstance(body.rid, list):
        rids = each(body.rid, "rid")
    else:  # a batch's prompts are the given id (or the call's) with their place after it, as SGLang names them
        base = body.rid or call_id
        rids = [f"{base}-{i}" for i in range(count)] if batch else [base]
    asks = each(body.return_logprob, "return_logprob")
    tops = each(body.top_logprobs_num, "top_logprobs_num")
    starts = each(body.logprob_start_len, "logprob_start_len")
    adapters = each(body.lora_path, "lora_path")
    calls = []
    for i, prompt in enumerate(prompts):
        top = tops[i] or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise invalid(f"top_logprobs_num must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs_num")
        start = -1 if starts[i] is None else starts[i]
        if start < -1:
            raise invalid(f"logprob_start_len must be -1 (the output alone) or a prompt position, got {start}",
                          "logprob_start_len")  # fmt: skip
        calls.append(PromptCall(prompt, samplings[i], str(rids[i]), bool(asks[i]), top, start,
                                body.return_text_in_logprobs, adapters[i]))  # fmt: skip
    return calls


def _sampling(fields: dict[str, Any]) -> SGLangSampling:
    """One prompt's sampling_params, checked; 400 naming the key for an unknown, bad or unserved one."""
    try:
        sampling = SGLangSampling.model_validate(fields)
    except pydantic.ValidationError as exc:
        raise invalid_body(exc, "sampling_params") from None
    refuse_unserved(sampling, UNSERVED_SAMPLING, "sampling_params")
    return sampling


def engine_request(call: PromptCall, request_id: str, cache_salt: str = "", adapter: str = ""
                   ) -> engine_pb2.GenerateRequest:  # fmt: skip
    """The engine request of one prompt: its sampling as SGLang's keys mean it (max_new_tokens 0 answers one token's
    worth of nothing: refused; no_stop_trim keeps the matched stop string), its constraint, its logprobs."""
    s = call.sampling
    if s.max_new_tokens == 0:
        raise invalid("max_new_tokens must be at least 1", "sampling_params.max_new_tokens")
    params = types_pb2.SamplingParams(
        n=s.n, min_tokens=s.min_new_tokens, stop=[s.stop] if isinstance(s.stop, str) else list(s.stop or []),
        stop_token_ids=s.stop_token_ids or [], ignore_eos=s.ignore_eos, skip_special_tokens=s.skip_special_tokens,
        include_stop_str_in_output=s.no_stop_trim, logprobs=call.logprobs, top_logprobs=call.top_logprobs,
    )  # fmt: skip
    optional: dict[str, Any] = {"max_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                                "top_k": s.top_k, "min_p": s.min_p, "frequency_penalty": s.frequency_penalty,
                                "presence_penalty": s.presence_penalty, "repetition_penalty": s.repetition_penalty}
    for name, value in optional.items():
        if value is not None:
            setattr(params, name, value)
    if s.sampling_seed is not None:
        params.seed = s.sampling_seed % ENGINE_SEEDS
    for key, bias in (s.logit_bias or {}).items():
        if not key.isdigit():
            raise invalid(f"logit_bias keys must be token ids, got {key!r}", "sampling_params.logit_bias")
        params.logit_bias[int(key)] = bias
    if call.logprobs and call.logprob_start >= 0:
        params.prompt_logprobs = call.top_logprobs
        params.return_prompt_token_ids = True
    request = engine_pb2.GenerateRequest(request_id=request_id, input=prompt_input(call.prompt, "input_ids"),
                                         sampling=params, cache_salt=cache_salt, adapter=adapter)  # fmt: skip
    constraints = [(k, v) for k, v in (("json_schema", s.json_schema), ("regex", s.regex), ("ebnf", s.ebnf)) if v]
    if len(constraints) > 1:
        raise invalid("set at most one of json_schema, regex and ebnf", f"sampling_params.{constraints[1][0]}")
    if constraints:
        kind, value = constraints[0]
        if kind == "json_schema":
            try:
                json.loads(value)
            except json.JSONDecodeError as exc:
                raise invalid(f"json_schema is not JSON: {exc}", "sampling_params.json_schema") from None
        setattr(request.constraint, "grammar" if kind == "ebnf" else kind, value)
    return request


@dataclass
class ChoiceState:
    """One choice's output as it grows (a stream's deltas joined, or a whole reply's choice)."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[types_pb2.TokenLogprob] = field(default_factory=list)
    finish: dict[str, Any] | None = None

    def add(self, text: str, ids: Any, logprobs: Any) -> None:
        self.text += text
        self.ids.extend(ids)
        self.logprobs.extend(logprobs)


def finish_reason(reason: int, matched: types_pb2.MatchedStop | None, length: int) -> dict[str, Any] | None:
    """SGLang's finish reason of an engine choice's; None while it runs."""
    if reason == types_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    if reason == types_pb2.FINISH_REASON_LENGTH:
        return {"type": "length", "length": length}
    if reason == types_pb2.FINISH_REASON_STOP:
        kind = matched.WhichOneof("kind") if matched is not None else None
        return {"type": "stop", "matched": getattr(matched, kind) if kind else None}
    return {"type": "abort", "message": "the request was aborted"}


def output(call: PromptCall, choice: ChoiceState, usage: types_pb2.Usage, latency: float,
           prompt: types_pb2.PromptLogprobs | None) -> dict[str, Any]:  # fmt: skip
    """One choice as SGLang's output dict."""
    meta: dict[str, Any] = {
        "id": call.rid, "finish_reason": choice.finish, "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": len(choice.ids), "cached_tokens": usage.cached_prompt_tokens,
        "e2e_latency": round(latency, 6),
    }  # fmt: skip
    if call.logprobs:
        def entry(lp: float | None, token_id: int, text: str) -> list[Any]:
            return [lp, token_id, text if call.text_in_logprobs else None]

        meta["output_token_logprobs"] = [entry(t.logprob, t.token_id, t.token) for t in choice.logprobs]
        meta["output_top_logprobs"] = [[entry(a.logprob, a.token_id, a.token) for a in t.top_logprobs] or None
                                       for t in choice.logprobs]  # fmt: skip
        if call.logprob_start >= 0 and prompt is not None:
            first = [entry(None, prompt.first_token_id, prompt.first_token)]
            rest = [entry(t.logprob, t.token_id, t.token) for t in prompt.tokens]
            meta["input_token_logprobs"] = (first + rest)[call.logprob_start:]
            tops = [None] + [[entry(a.logprob, a.token_id, a.token) for a in t.top_logprobs] or None
                             for t in prompt.tokens]  # fmt: skip
            meta["input_top_logprobs"] = tops[call.logprob_start:]
    return {"text": choice.text, "output_ids": list(choice.ids), "meta_info": meta}


def whole_choice(choice: types_pb2.Choice) -> ChoiceState:
    """A finished choice of a Generate reply."""
    state = ChoiceState()
    state.add(choice.text, choice.token_ids, choice.logprobs)
    matched = choice.matched_stop if choice.HasField("matched_stop") else None
    state.finish = finish_reason(choice.finish_reason, matched, len(state.ids))
    return state
