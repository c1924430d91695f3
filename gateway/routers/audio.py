"""`POST /v1/audio/transcriptions` and `POST /v1/audio/translations`: OpenAI's speech-to-text, one clip per call.

The body is OpenAI's multipart form, read by `gateway.audio_form` (the clip capped by --max-audio-mib, not by the
request-size limit) and checked by `schemas.audio`; the clip's bytes go to the engine as they came (the engine
decodes them) in one Generate call, or one Stream call with `stream=true`, whose `Input.transcription` says the
task by route. The answer is each `response_format`'s (`translate.transcriptions`); a stream is OpenAI's
`transcript.text.delta` events and a `transcript.text.done` event with the usage. An engine's refusal (a model
that does not transcribe, a clip too long, an unknown language) is a 400 naming the form's field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import pydantic
from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from gateway import calls, sse
from gateway.audio_form import receive_audio_form
from gateway.deps import (
    CallId,
    Config,
    HttpRequest,
    Limiter,
    Metrics,
    Pool,
    Project,
    RequestTimer,
    require_api_key,
    served_or_default,
)
from gateway.errors import APIError, invalid, invalid_body
from gateway.json_output import FiniteJSONResponse
from gateway.schemas.audio import LIST_FIELDS, Task, TranscriptionForm
from gateway.streaming import transcript_events
from gateway.translate import transcriptions
from gateway.translate.cache_salt import project_cache_salt

TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"
router = APIRouter(dependencies=[Depends(require_api_key)])

# The body is read as a stream (gateway.audio_form), not by FastAPI's form parsing, so it is documented here: the
# schema's fields (a form field is absent rather than null) and the SDK's `[]` spelling of the lists.
def _form_field(spec: dict[str, Any]) -> dict[str, Any]:
    kinds = [kind for kind in spec.get("anyOf", []) if kind.get("type") != "null"]
    rest = {key: value for key, value in spec.items() if key != "anyOf"}
    return {**rest, **kinds[0]} if len(kinds) == 1 else spec


FORM_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object",
    "required": ["file"],
    "properties": {
        "file": {"type": "string", "format": "binary",
                 "description": "The clip (wav, mp3, flac, ogg...), decoded by the engine"},
        **{f"{name}[]" if name in LIST_FIELDS else name: _form_field(spec)
           for name, spec in TranscriptionForm.model_json_schema()["properties"].items()},
    },
}}}}}
RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {**{media: {"schema": {"type": "string"}} for media in ("text/plain", "application/x-subrip",
                                                                             "text/vtt")},
                      "text/event-stream": {"schema": sse.SSE_EVENT_SCHEMA}},
          "description": "The text: JSON (json, verbose_json), plain text (text, srt, vtt), or with `stream=true` "
                         "transcript.text.delta events and a transcript.text.done event"},
}


@dataclass(frozen=True)
class SpeechCall:
    """What a speech-to-text call uses besides its form: a dependency FastAPI fills from the route's."""

    http: HttpRequest
    pool: Pool
    metrics: Metrics
    rid: CallId
    project: Project
    config: Config
    limiter: Limiter


Speech = Annotated[SpeechCall, Depends()]


@router.post(TRANSCRIPTIONS, response_model=None, openapi_extra=FORM_BODY, responses=RESPONSES)
async def create_transcription(call: Speech) -> Any:
    return await _speech_to_text(call, "transcribe", TRANSCRIPTIONS)


@router.post(TRANSLATIONS, response_model=None, openapi_extra=FORM_BODY, responses=RESPONSES)
async def create_translation(call: Speech) -> Any:
    return await _speech_to_text(call, "translate", TRANSLATIONS)


async def _speech_to_text(call: SpeechCall, task: Task, route: str) -> Any:
    """The clip of `call`'s form as `task`, answered in its response_format (or streamed); `route` labels it."""
    http, pool, project = call.http, call.pool, call.project
    received = await receive_audio_form(http, call.config.max_audio_bytes)
    try:
        form = TranscriptionForm.model_validate(received.values(LIST_FIELDS))
    except pydantic.ValidationError as exc:
        raise invalid_body(exc) from None
    if received.file is None:
        raise invalid("the form has no `file` part: send the audio as `file`", "file")
    if not received.file:
        raise invalid("the audio file is empty", "file")
    served = served_or_default(pool, form.model)
    request = transcriptions.transcription_request(form, received.file, task, call.rid, project_cache_salt(project),
                                                   served.adapter)
    # The clip is not text: the rate limiter's estimate is of the form's text alone, and the output cap.
    admission = await call.limiter.admit(http.state, project, received.text_bytes, form.max_completion_tokens)
    timer = RequestTimer(call.metrics, route, project, served.id, admission)
    try:
        if form.stream:
            messages = await calls.started(calls.stream(pool, request))
            return sse.response(transcript_events(messages, timer, form.want_logprobs))
        reply = await calls.generate(pool, request)
    except APIError as error:
        if error.status == 400:
            error.param = transcriptions.form_param(error.param)
        raise
    timer.finish([reply.usage])
    body, media_type = transcriptions.answer(form, task, reply)
    if isinstance(body, str):
        return PlainTextResponse(body, media_type=media_type)
    return FiniteJSONResponse(body)
