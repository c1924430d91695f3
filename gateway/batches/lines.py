"""Batch input lines in, result lines out: parsing and validating one JSONL line as the matching route would,
and OpenAI's shapes for the lines of the output and error files. Pure functions.

An input line is `{"custom_id": str, "method": "POST", "url": <the batch's endpoint>, "body": {...}}`; the url
may name the endpoint with or without its `/v1` prefix (`/chat/completions` as SGLang's tutorial writes it, `/score`
and `/rerank` as vLLM's run_batch takes them; `/v2/rerank` is `/v1/rerank`). The endpoints are the generation
routes' (`/v1/responses` among them) and the pooling routes' (`/v1/embeddings`, `/v1/score`, `/v1/rerank`), whose
lines become Embed and Score items of the engine's Batch call. A `/v1/responses` line is not stored (its Response
is in the output file) and carries its whole conversation: `previous_response_id`, `background` and `stream` are
refused. The body is checked with the route's own pydantic schema and
`translate.to_engine` or `translate.pooling_to_engine`, so a line that validates here is a request the synchronous
route would also accept. A generation line's `model` may name a LoRA adapter the engines serve (`line_adapter`):
its requests carry it, and its response names it; a pooling line naming one is refused, as the routes refuse it.
A chat or responses line's images (and a chat line's audio clips: `image_sources`) are checked here (a data: URL
or input_audio data decoded, an http(s) URL's form) and fetched only when the line runs (`line_media`): a fetch
that fails is that line's error line. A responses line's input_image given by file_id is refused (a line is not
read against its project's files).
Validation never raises for a line's content: whatever is wrong with a line (JSON nested too deep for the parser,
a lone UTF-16 surrogate that no UTF-8 file or protobuf can carry, a value the engine request cannot hold) becomes
that line's `LineError`, and a line that validates can be sent to the engine and written to the result files.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import pydantic
import structlog

from gateway import json_output
from gateway.errors import APIError, invalid, unknown_model_message, validation_param
from gateway.schemas.chat import ChatCompletionRequest
from gateway.schemas.completions import CompletionRequest
from gateway.schemas.pooling import EmbeddingRequest, RerankRequest, ScoreRequest
from gateway.schemas.responses import ResponsesRequest
from gateway.store.ids import RESPONSE_PREFIX, new_id
from gateway.translate import (
    from_engine,
    pooling_from_engine,
    pooling_to_engine,
    responses_from_engine,
    responses_to_engine,
    to_engine,
)
from gateway.translate.media_parts import MediaSource, chat_media_sources, unfetched
from ladle.v1 import engine_pb2, types_pb2

if TYPE_CHECKING:  # not at run time: the validation child imports this module, and calls imports the pool
    from gateway.calls import EngineReply, EngineRequest

MAX_LINES = 50_000
MAX_CUSTOM_ID_CHARS = 512
MAX_REPORTED_ERRORS = 1000  # a file with more bad lines reports the first ones (the batch fails either way)
Body = ChatCompletionRequest | CompletionRequest | ResponsesRequest | EmbeddingRequest | ScoreRequest | RerankRequest
GENERATION_BODIES = (ChatCompletionRequest, CompletionRequest, ResponsesRequest)  # may name a LoRA adapter
ENDPOINTS: dict[str, type[Body]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/score": ScoreRequest,
    "/v1/rerank": RerankRequest,
}
ALIASES = {"/v2/rerank": "/v1/rerank"}  # vLLM serves Cohere's v2 path for its rerank too

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class InputLine:
    """One request of a batch: `index` counts the file's non-blank lines from 0. `images` holds the bytes of its
    image and audio URLs once fetched (`line_media`), or `media_error` why they could not be."""

    index: int
    custom_id: str
    body: Body
    images: Mapping[str, bytes] = field(default_factory=dict, repr=False, compare=False)
    media_error: APIError | None = field(default=None, compare=False)


@dataclass(frozen=True)
class LineError:
    """Why a line is refused; `line` is the 1-based line number in the file, as OpenAI reports it."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


class InvalidLineError(Exception):
    def __init__(self, error: LineError) -> None:
        super().__init__(error.message)
        self.error = error


def read_lines(file: BinaryIO, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(1-based line number, content) for every non-blank line; content is None for a line longer than
    `max_line_bytes`, which is skipped without being held in memory."""
    number = 0
    while True:
        raw = file.readline(max_line_bytes + 1)
        if not raw:
            return
        number += 1
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            while (rest := file.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield number, None
        elif raw.strip():
            yield number, raw


def parse_line(
    raw: bytes, number: int, index: int, endpoint: str | None, model: str | None,
    info: engine_pb2.GetModelInfoResponse | None = None, adapters: Collection[str] = (),
) -> InputLine:
    """The request on line `number` (1-based) of a batch for `endpoint` (None: any supported endpoint, each line
    its own); InvalidLineError says what is wrong. `model`, when given, is the only model id a body may name
    besides the LoRA `adapters` (which only a generation body may name);
    `info`, the engine's model info when known, bounds a pooling body as the synchronous routes bound it (e.g.
    `dimensions` at most the model's). What only the engine can check (a prompt's length in tokens: the gateway
    holds no tokenizer) it checks when the line runs, and refuses that line alone, as the route answers a 400."""

    def refuse(code: str, message: str, param: str | None = None) -> InvalidLineError:
        return InvalidLineError(LineError(code, message, number, param))

    try:
        item = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise refuse("invalid_json_line", f"line {number} is not valid JSON") from None
    except RecursionError:
        raise refuse("invalid_json_line", f"line {number} nests arrays or objects too deeply") from None
    if not isinstance(item, dict):
        raise refuse("invalid_json_line", f"line {number} is not a JSON object")
    for key, value in item.items():
        try:
            json.dumps([key, value], ensure_ascii=False).encode()
        except UnicodeEncodeError:
            where = key if key in ("custom_id", "body") else None
            raise refuse("invalid_body" if key == "body" else "invalid_json_line",
                         f"line {number}: {key!r} holds a lone UTF-16 surrogate escape (\\ud800-\\udfff not part of "
                         "a pair), which is not valid Unicode", where) from None
        except RecursionError:
            raise refuse("invalid_json_line", f"line {number} nests arrays or objects too deeply") from None
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise refuse("missing_custom_id", f"line {number} has no custom_id (a non-empty string)", "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise refuse("invalid_custom_id", f"custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters", "custom_id")
    if item.get("method") != "POST":
        raise refuse("invalid_method", f"method must be POST, got {item.get('method')!r}", "method")
    url = endpoint_of(item.get("url"))
    if endpoint is None and url is None:
        raise refuse("invalid_url", f"url must be one of {', '.join(sorted(ENDPOINTS))} (the /v1 prefix may be "
                     f"left out), got {item.get('url')!r}", "url")
    if endpoint is not None and url != endpoint:
        raise refuse("invalid_url", f"url must be the batch's endpoint {endpoint} (or {endpoint.removeprefix('/v1')}"
                     f"), got {item.get('url')!r}", "url")
    assert url is not None
    if not isinstance(item.get("body"), dict):
        raise refuse("invalid_body", "body must be a JSON object", "body")
    try:
        body = ENDPOINTS[url].model_validate(item["body"])
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        param = validation_param(tuple(first.get("loc", ())))
        where = f"body.{param}" if param else "body"
        raise refuse("invalid_body", f"{where}: {first.get('msg', 'invalid value')}", where) from None
    if getattr(body, "stream", False):
        raise refuse("invalid_body", "body.stream: streaming is not supported in a batch", "body.stream")
    if getattr(body, "lora_path", None):
        raise refuse("invalid_body", "body.lora_path: a batch line names its LoRA adapter in body.model",
                     "body.lora_path")  # fmt: skip
    if model is not None and body.model is not None and body.model != model:  # score/rerank may leave it out
        if body.model not in adapters:
            message = unknown_model_message(body.model, model, list(adapters))
            raise refuse("model_not_found", f"body.model: {message[0].lower()}{message[1:]}", "body.model")
        if not isinstance(body, GENERATION_BODIES):
            raise refuse("invalid_body", f"body.model: `{body.model}` is a LoRA adapter, which serves generation "
                         f"only; use the model `{model}` for {url}", "body.model")
    line = InputLine(index, custom_id, body)
    try:
        checked = replace(line, images=unfetched(image_sources(line)))  # http(s) images stand empty until it runs
        for request in engine_requests(checked, "validation", info):
            request.SerializeToString()
    except APIError as exc:
        raise refuse("invalid_body", f"body: {exc.message}", f"body.{exc.param}" if exc.param else "body") from None
    except ValueError as exc:  # protobuf refuses the value (e.g. text it cannot encode)
        raise refuse("invalid_body", f"body: a value cannot be sent to the engine ({exc})", "body") from None
    return line


def endpoint_of(url: object) -> str | None:
    """The endpoint a line's url names: one of ENDPOINTS (or ALIASES), written with or without its `/v1` prefix;
    else None."""
    if not isinstance(url, str):
        return None
    url = ALIASES.get(url, url)
    if url in ENDPOINTS:
        return url
    prefixed = "/v1" + url
    return prefixed if url.startswith("/") and prefixed in ENDPOINTS else None


def validate(
    lines: Iterable[tuple[int, bytes | None]], endpoint: str | None, model: str | None, max_lines: int = MAX_LINES,
    info: engine_pb2.GetModelInfoResponse | None = None, adapters: Collection[str] = (),
) -> tuple[int, list[LineError]]:
    """Check every line of a batch file (against `model`, `info` and `adapters`, as `parse_line`): (number of
    requests, errors). No error means every line is runnable."""
    errors: list[LineError] = []
    seen: set[str] = set()
    count = 0
    for number, raw in lines:
        count += 1
        if count > max_lines:
            errors.append(LineError("too_many_requests", f"a batch holds at most {max_lines} requests", number))
            break
        if raw is None:
            errors.append(LineError("line_too_long", f"line {number} is longer than the request size limit",
                                    number))
            continue
        try:
            line = parse_line(raw, number, count - 1, endpoint, model, info, adapters)
        except InvalidLineError as exc:
            errors.append(exc.error)
            continue
        except Exception as exc:  # a case parse_line does not name: still this line's error, never the batch's
            log.exception("batch line could not be checked", line=number)
            errors.append(LineError("invalid_line", f"line {number} could not be read ({type(exc).__name__})",
                                    number))
            continue
        if line.custom_id in seen:
            errors.append(LineError("duplicate_custom_id", f"custom_id {line.custom_id!r} is used more than once",
                                    number, "custom_id"))
        seen.add(line.custom_id)
    if count == 0:
        errors.append(LineError("empty_file", "the input file holds no requests"))
    return count, errors[:MAX_REPORTED_ERRORS]


def line_adapter(line: InputLine, model: str) -> str:
    """The LoRA adapter a generation line's `model` names when it is not the served `model` ("" otherwise: the
    base model). Validation let through only the adapters served then; the engine refuses one unloaded since."""
    body = line.body
    if isinstance(body, GENERATION_BODIES) and body.model and body.model != model:
        return body.model
    return ""


def image_sources(line: InputLine) -> list[MediaSource]:
    """The images a chat or responses line holds, and a chat line's audio clips (none for the other endpoints),
    named as the route names them; 400 for a responses line's input_image given by file_id (not read in batches)."""
    body = line.body
    if isinstance(body, ChatCompletionRequest):
        return chat_media_sources(body.messages)
    if isinstance(body, ResponsesRequest) and not isinstance(body.input, str):
        items = responses_to_engine.input_items(body)
        by_file = responses_to_engine.file_image_sources([], items, "input")
        if by_file:  # a batch's lines are not read against its project's files
            raise invalid("an input_image given by file_id is not read in a batch line; give it as image_url (a "
                          "data: URL or an http(s) URL)", by_file[0].param)
        return responses_to_engine.image_sources([], items, "input")
    return []


def engine_requests(
    line: InputLine, request_id: str, info: engine_pb2.GetModelInfoResponse | None = None, *, cache_salt: str = "",
    adapter: str = "",
) -> list[EngineRequest]:
    """The engine requests for one line at batch priority: one, or one per prompt of a completions body with
    several (ids `{request_id}-{i}`), or one per distinct query of an N-vs-N score body. `info` as the routes
    pass it to `translate.pooling_to_engine`; `cache_salt` the batch's project's
    (`translate.cache_salt.project_cache_salt`), combined with a body's own `cache_salt` as the routes do;
    `adapter` the line's LoRA adapter (`line_adapter`), for a generation line; images from `line.images`.
    APIError if the body cannot be expressed (or its images could not be fetched: `line.media_error`)."""
    if line.media_error is not None:
        raise line.media_error
    body = line.body
    requests: list[EngineRequest]
    if isinstance(body, ChatCompletionRequest):
        requests = [to_engine.chat_request(body, body.messages, request_id, cache_salt=cache_salt, adapter=adapter,
                                           images=line.images)]
    elif isinstance(body, CompletionRequest):
        requests = list(to_engine.completion_requests(body, request_id, cache_salt=cache_salt, adapter=adapter))
    elif isinstance(body, ResponsesRequest):
        requests = [_responses_request(body, request_id, cache_salt, adapter, line.images)]
    elif isinstance(body, EmbeddingRequest):
        requests = [pooling_to_engine.embed_request(body, request_id, info, cache_salt=cache_salt)]
    elif isinstance(body, ScoreRequest):
        requests = list(pooling_to_engine.score_requests(body, request_id, info, cache_salt=cache_salt))
    else:
        requests = [pooling_to_engine.rerank_request(body, request_id, info, cache_salt=cache_salt)]
    for request in requests:
        request.priority = types_pb2.PRIORITY_BATCH
    return requests


def response_body(line: InputLine, replies: Sequence[EngineReply], request_id: str, model: str) -> dict[str, Any]:
    """What the synchronous route would have answered for this line, given its requests' replies in order."""
    body = line.body
    if isinstance(body, ChatCompletionRequest):
        return from_engine.chat_completion(body, _of(engine_pb2.GenerateResponse, replies)[0],
                                           f"chatcmpl-{request_id}", model, body.echoed())
    if isinstance(body, CompletionRequest):
        return from_engine.text_completion(body, _of(engine_pb2.GenerateResponse, replies), f"cmpl-{request_id}",
                                           model)
    if isinstance(body, ResponsesRequest):
        reply = _of(engine_pb2.GenerateResponse, replies)[0]
        shell = responses_from_engine.response_shell(body, new_id(RESPONSE_PREFIX), model, "in_progress")
        return responses_from_engine.from_reply(dict(shell, store=False), reply,
                                                 responses_to_engine.wants_logprobs(body))
    if isinstance(body, EmbeddingRequest):
        return pooling_from_engine.embedding_list(_of(engine_pb2.EmbedResponse, replies)[0], model,
                                                  body.encoding_format)
    if isinstance(body, ScoreRequest):
        groups = pooling_to_engine.score_groups(pooling_to_engine.score_pairs(body)[0])
        return pooling_from_engine.score_list(groups, _of(engine_pb2.ScoreResponse, replies), f"score-{request_id}",
                                              model)
    return pooling_from_engine.rerank_result(body, _of(engine_pb2.ScoreResponse, replies)[0], f"rerank-{request_id}",
                                             model)


def _responses_request(
    body: ResponsesRequest, request_id: str, cache_salt: str, adapter: str, images: Mapping[str, bytes]
) -> engine_pb2.GenerateRequest:
    for name in ("previous_response_id", "conversation", "background"):
        if getattr(body, name):
            raise APIError(400, f"{name} is not supported in a batch line: send the whole conversation as input "
                           "items", param=name)
    items = responses_to_engine.input_items(body)
    return responses_to_engine.generate_request(body, items, request_id, cache_salt=cache_salt, adapter=adapter,
                                                images=images)


ReplyT = TypeVar("ReplyT", engine_pb2.GenerateResponse, engine_pb2.EmbedResponse, engine_pb2.ScoreResponse)


def _of(kind: type[ReplyT], replies: Sequence[EngineReply]) -> list[ReplyT]:
    """The replies, each checked to be what the line's requests return (a Batch item answered in kind)."""
    for reply in replies:
        if not isinstance(reply, kind):
            raise TypeError(f"expected {kind.__name__} results, got {type(reply).__name__}")
    return [r for r in replies if isinstance(r, kind)]


def output_record(line_id: str, custom_id: str, request_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """A line of the output file (status 200) or of the error file (the request's error status and body)."""
    return {
        "id": line_id,
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def unrun_record(line_id: str, custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A line of the error file for a request that never ran (e.g. code batch_expired)."""
    return {"id": line_id, "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}


def encode(record: dict[str, Any]) -> bytes:
    """One JSONL line, valid JSON whatever it holds: a non-finite float (a logprob of -inf, a NaN in an
    embedding) is written as `json_output` maps it, never as a `NaN` token; a string UTF-8 cannot hold (a lone
    surrogate; validation refuses such input) is written escaped rather than failing the write. A result line is
    never lost to its encoding."""
    try:
        return json_output.dumps(record).encode() + b"\n"
    except UnicodeEncodeError:
        return json_output.dumps(record, ensure_ascii=True).encode() + b"\n"
