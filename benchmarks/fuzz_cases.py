"""What both schema-fuzzing profiles share (tests/fuzz in CI, `ladle bench fuzz` for the long run): making
positive generation and pooling bodies cheap, OpenAI's error-shape check, the tally of cases and answers, and how a
schemathesis schema is set up (modes, checks, determinism)."""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/chat/completions/batch",
                               "/v1/responses"})
CHEAP_MAX_TOKENS = 4
CHEAP_N = 2
CHEAP_ITEMS = 4  # prompts (or prompt token ids), messages, conversations; pooling inputs, texts, documents
POOLING_ROUTES = frozenset({"/v1/embeddings", "/v1/score", "/v1/rerank"})
SGLANG_ROUTE = "/generate"  # SGLang's native body: no model; its caps inside sampling_params
CHEAP_TEXT_CHARS = 64  # each pooling text (an input, a score side's text, a query, a document)
CHEAP_INPUT_TOKENS = 16  # each token-id input of an embeddings body
# Every pooling body's fields that hold texts or token-id inputs: embeddings' input, score's sides, rerank's.
POOLING_TEXT_FIELDS = ("input", "text_1", "text_2", "queries", "documents", "items", "data_1", "data_2", "query")
ERROR_FIELDS = frozenset({"message", "type", "param", "code"})
# schemathesis' checks that hold for this gateway. `positive_data_acceptance` is left out: the document cannot
# express every rule (a token id within the vocabulary, a JSON schema xgrammar compiles, best_of == n), so a
# schema-valid body may rightly get a 400.
CHECK_NAMES = (
    "not_a_server_error", "status_code_conformance", "content_type_conformance", "response_schema_conformance",
    "negative_data_rejection",
)
REQUEST_TIMEOUT_S = 120.0
MAX_FAILURES_KEPT = 50


def cheapen_body(body: Mapping[str, Any], model: str) -> dict[str, Any]:
    """A copy of a schema-valid generation body that is still valid but cheap for the engine: `model` set to the
    served one, max_tokens / max_completion_tokens / min_tokens at most CHEAP_MAX_TOKENS (max_tokens set when
    neither cap is; a Responses body's max_output_tokens likewise), n and best_of at most CHEAP_N, at most CHEAP_ITEMS
    prompts, messages, conversations or input items."""
    cheap = {**body, "model": model}
    for key, cap in (("max_tokens", CHEAP_MAX_TOKENS), ("max_completion_tokens", CHEAP_MAX_TOKENS),
                     ("max_output_tokens", CHEAP_MAX_TOKENS), ("min_tokens", CHEAP_MAX_TOKENS), ("n", CHEAP_N),
                     ("best_of", CHEAP_N)):
        if _is_number(cheap.get(key)):
            cheap[key] = min(cheap[key], cap)
    if "input" in cheap:  # a Responses body
        if not _is_number(cheap.get("max_output_tokens")):
            cheap["max_output_tokens"] = CHEAP_MAX_TOKENS
    elif not _is_number(cheap.get("max_tokens")) and not _is_number(cheap.get("max_completion_tokens")):
        cheap["max_tokens"] = CHEAP_MAX_TOKENS
    for key in ("prompt", "messages", "input"):
        if isinstance(cheap.get(key), list):
            cheap[key] = cheap[key][:CHEAP_ITEMS]
    return cheap


def cheapen_sglang_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a schema-valid SGLang `/generate` body that is cheap for the engine: at most CHEAP_ITEMS prompts,
    and each sampling_params' max_new_tokens at most CHEAP_MAX_TOKENS (set when absent) and n at most CHEAP_N."""
    cheap = dict(body)
    for key in ("text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
                "top_logprobs_num", "lora_path"):
        if isinstance(cheap.get(key), list) and cheap[key] and isinstance(cheap[key][0], list | dict | str | bool):
            cheap[key] = cheap[key][:CHEAP_ITEMS]

    def capped(sampling: Any) -> Any:
        if not isinstance(sampling, dict):
            return sampling
        sampling = dict(sampling)
        tokens = sampling.get("max_new_tokens", CHEAP_MAX_TOKENS)
        sampling["max_new_tokens"] = min(tokens, CHEAP_MAX_TOKENS) if _is_number(tokens) else CHEAP_MAX_TOKENS
        if _is_number(sampling.get("n")):
            sampling["n"] = min(sampling["n"], CHEAP_N)
        return sampling

    params = cheap.get("sampling_params")
    cheap["sampling_params"] = [capped(s) for s in params] if isinstance(params, list) else capped(params or {})
    return cheap


def cheapen_pooling_body(body: Mapping[str, Any], model: str) -> dict[str, Any]:
    """A copy of a schema-valid /v1/embeddings, /v1/score or /v1/rerank body that is still valid but cheap for the
    engine: `model` set to the served one, at most CHEAP_ITEMS inputs, texts per score side, documents or chat
    messages, each text cut to CHEAP_TEXT_CHARS and each token-id input to CHEAP_INPUT_TOKENS. Lists are cut, never
    emptied, so an N-vs-N score body still pairs up and a 1-vs-N one stays 1 vs N."""
    cheap = {**body, "model": model}
    for key in POOLING_TEXT_FIELDS:
        if key in cheap:
            cheap[key] = _shorten(cheap[key])
    if isinstance(cheap.get("messages"), list):
        cheap["messages"] = cheap["messages"][:CHEAP_ITEMS]
    return cheap


def _shorten(value: Any) -> Any:
    """A pooling text field's value with fewer and shorter items: a string cut, a token-id list cut to
    CHEAP_INPUT_TOKENS ids (it is one input), any other list cut to CHEAP_ITEMS items, each shortened, and a
    document object's `text` cut. Anything else (null, a wrong type in a negative body) as it was."""
    if isinstance(value, str):
        return value[:CHEAP_TEXT_CHARS]
    if isinstance(value, list) and value and all(_is_number(v) for v in value):
        return value[:CHEAP_INPUT_TOKENS]
    if isinstance(value, list):
        return [_shorten(v) for v in value[:CHEAP_ITEMS]]
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        return {**value, "text": value["text"][:CHEAP_TEXT_CHARS]}
    return value


def _is_number(value: Any) -> bool:
    # JSON Schema's integers include 149.0, so a generated count may be a float.
    return isinstance(value, int | float) and not isinstance(value, bool)


def cheapen_case(case: Any, model: str) -> Any:
    """`case` (a schemathesis Case) with its body cheapened when it is a positive body on a generating or pooling
    route; any other case is returned untouched, so negative data goes out exactly as drawn."""
    from schemathesis import GenerationMode

    meta = case.meta
    body_info = meta.components.get("body") if meta is not None else None
    positive_body = body_info is not None and body_info.mode == GenerationMode.POSITIVE
    if not positive_body or not isinstance(case.body, dict):
        return case
    if case.path in GENERATION_ROUTES:
        case.body = cheapen_body(case.body, model)
    elif case.path == SGLANG_ROUTE:
        case.body = cheapen_sglang_body(case.body)
    elif case.path in POOLING_ROUTES:
        case.body = cheapen_pooling_body(case.body, model)
    return case


def error_shape_problem(status: int, content_type: str, body: bytes) -> str | None:
    """What is wrong with an error response (status >= 400) against OpenAI's error shape
    `{"error": {"message": str, "type": str, "param": str | null, "code": str | null}}`; None when nothing is
    (or when it is no error)."""
    if status < 400:
        return None
    if content_type.split(";")[0].strip() != "application/json":
        return f"content type {content_type!r}, not application/json"
    try:
        payload = json.loads(body)
    except ValueError:
        return "the body is not JSON"
    if not isinstance(payload, dict) or set(payload) != {"error"} or not isinstance(payload["error"], dict):
        return f"the body is not {{'error': {{...}}}}: {body[:200]!r}"
    error = payload["error"]
    if set(error) != ERROR_FIELDS:
        return f"error fields {sorted(error)}, not {sorted(ERROR_FIELDS)}"
    if not isinstance(error["message"], str) or not error["message"] or not isinstance(error["type"], str):
        return f"error.message / error.type are not non-empty strings: {error}"
    if not all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")):
        return f"error.param / error.code are neither strings nor null: {error}"
    return None


def configure_schema(schema: Any, *, max_examples: int, seed: int, phases: Sequence[str]) -> Any:
    """Set a loaded schemathesis schema up as both profiles use it: positive and negative cases, `max_examples`
    per hypothesis run in the fuzzing phase, derandomized from `seed`, no example database on disk, `phases`,
    the checks of CHECK_NAMES, REQUEST_TIMEOUT_S per request."""
    from schemathesis import GenerationMode
    from schemathesis.config import HealthCheck

    schema.config.seed = seed
    schema.config.phases.update(phases=list(phases))
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=max_examples, deterministic=True,
        database="none",
    )
    schema.config.checks.update(included_check_names=list(CHECK_NAMES))
    # Negative values for a path parameter are mostly filtered out (whatever is drawn, a path is text), which
    # hypothesis' health check would report as an error of the run rather than of the gateway.
    schema.config.update(request_timeout=REQUEST_TIMEOUT_S, suppress_health_check=[HealthCheck.filter_too_much])
    return schema


@dataclass
class OperationTally:
    """What one API operation was sent and answered."""

    examples: int = 0
    positive: int = 0
    negative: int = 0
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    phases: collections.Counter[str] = field(default_factory=collections.Counter)  # examples, coverage, ...

    def as_json(self) -> dict[str, Any]:
        return {"examples": self.examples, "positive": self.positive, "negative": self.negative,
                "phases": dict(sorted(self.phases.items())), "statuses": dict(sorted(self.statuses.items()))}


@dataclass
class FuzzTally:
    """Every case sent in a run: per operation, 5xx responses, error bodies out of shape, check failures."""

    operations: dict[str, OperationTally] = field(default_factory=dict)
    server_errors: int = 0
    shape_problems: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    failure_count: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def examples(self) -> int:
        return sum(t.examples for t in self.operations.values())

    def record(self, case: Any, response: Any) -> str | None:
        """Count one case and its schemathesis Response (None: no response); the error-shape problem, if any."""
        from schemathesis import GenerationMode

        tally = self.operations.setdefault(f"{case.method} {case.path}", OperationTally())
        tally.examples += 1
        meta = case.meta
        tally.phases[meta.phase.name.value if meta is not None else "unknown"] += 1
        if meta is not None and meta.generation.mode == GenerationMode.NEGATIVE:
            tally.negative += 1
        else:
            tally.positive += 1
        tally.statuses["none" if response is None else str(response.status_code)] += 1
        if response is None:
            return None
        if response.status_code >= 500:
            self.server_errors += 1
        content_type = (response.headers.get("content-type") or [""])[0]
        problem = error_shape_problem(response.status_code, content_type, response.content or b"")
        if problem is not None:
            self.shape_problems += 1
            self.add_failure(case, "error_shape", problem, response.status_code)
        return problem

    def add_failure(self, case: Any, check: str, message: str, status: int | None) -> None:
        self.failure_count += 1
        if len(self.failures) < MAX_FAILURES_KEPT:
            self.failures.append({"operation": f"{case.method} {case.path}", "check": check, "status": status,
                                  "message": message[:500], "body": _short(case.body)})


def _short(body: Any) -> str:
    try:
        text = json.dumps(body, default=repr)
    except (TypeError, ValueError):
        text = repr(body)
    return text[:500]
