"""OpenAI's speech-to-text forms <-> ladle.v1: a transcription or translation form and its clip as one
GenerateRequest with `Input.transcription`, and the engine's reply as each `response_format` answers it. Pure
functions.

The formats that show times (verbose_json, srt, vtt) ask the engine for Whisper's timestamp tokens
(`Transcription.timestamps`), and each of the engine's TranscriptionSegments answers as one of verbose_json's
`segments` (its times, untrimmed text, token ids with their timestamp tokens, Whisper's `seek`, the temperature of
the decode it came from, its tokens' mean log-probability, Whisper's compression ratio, its window's `no_speech_prob`
where the engine measured it, else null) and as one srt or vtt cue (its text trimmed).
A form whose `temperature` is unset or 0 asks Whisper's temperature fallback (`Transcription.temperature_fallback`),
as OpenAI documents whisper-1's: "the model will use log probability to automatically increase the temperature
until certain thresholds are hit"; a stream does not (it decodes each window once, greedily, so that its deltas come
as they are made), nor a form with `temperature_fallback` false (ladle's extra).
`timestamp_granularities[]` `word` (verbose_json only) asks the engine's word timings (`Transcription.word_timestamps`:
Whisper's cross-attention alignment) and answers its words (`words`: each word without its leading space, its start
and end); `segment`, or no granularity, answers `segments`; `word` alone answers no segments (the engine is then not
asked for timestamps). An engine's reply with text but no segments (one that ignores timestamps) answers as one
segment over the whole clip.
The text answered is the model's with its surrounding white space trimmed (Whisper starts with a space), as OpenAI
answers.
Usage is OpenAI's token usage (`{"type": "tokens", ...}`) in json and in a stream's done event, the clip's seconds
(`{"type": "duration", ...}`) in verbose_json, as the SDK types them.
"""

from __future__ import annotations

import itertools
import zlib
from typing import Any

from gateway.errors import invalid
from gateway.schemas.audio import STREAMED_FORMATS, Task, TranscriptionForm
from gateway.translate.languages import ENGLISH, language_name
from gateway.translate.to_engine import ENGINE_SEEDS
from ladle.v1 import engine_pb2, types_pb2

TASKS = {"transcribe": types_pb2.TRANSCRIPTION_TASK_TRANSCRIBE, "translate": types_pb2.TRANSCRIPTION_TASK_TRANSLATE}
TIMED_FORMATS = frozenset({"verbose_json", "srt", "vtt"})  # the formats that show times: asked with timestamps
MEDIA_TYPES = {"json": "application/json", "verbose_json": "application/json", "text": "text/plain",
               "srt": "application/x-subrip", "vtt": "text/vtt"}
# The engine's names for a transcription's fields (its INVALID_ARGUMENT's `ladle-param`) -> the form's.
_FORM_PARAMS = {"audio": "file", "audio.data": "file", "input": "file", "max_tokens": "max_completion_tokens",
                "timestamps": "response_format", "word_timestamps": "timestamp_granularities"}
_OPTIONAL_SAMPLING = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def check_form(form: TranscriptionForm) -> None:
    """400 naming the field for what the engine cannot give or the answer cannot show: `word` timestamps in a format
    other than verbose_json (as OpenAI), an `include` other than logprobs, logprobs in a format other than json (as
    OpenAI), a stream in a format other than json or text (its events are text), and a translation into another
    language than English."""
    if "word" in form.timestamp_granularities and form.response_format != "verbose_json":
        raise invalid("timestamp_granularities: `word` timestamps come with response_format verbose_json only, as "
                      "OpenAI gives them", "timestamp_granularities")
    for item in form.include:
        if item != "logprobs":
            raise invalid(f"include: {item!r} is not available; the one include this server gives is 'logprobs'",
                          "include")
    if form.include and form.response_format != "json":
        raise invalid("include: 'logprobs' comes with response_format json only, as OpenAI gives it", "include")
    if form.stream and form.response_format not in STREAMED_FORMATS:
        raise invalid(f"stream: a stream sends text events; response_format must be json or text, not "
                      f"{form.response_format}", "stream")
    if form.to_language is not None and form.to_language.lower() not in ("", "en", "english"):
        raise invalid(f"to_language: the model translates into English only, not {form.to_language!r}",
                      "to_language")


def transcription_request(
    form: TranscriptionForm, audio: bytes, task: Task, request_id: str, cache_salt: str = "", adapter: str = ""
) -> engine_pb2.GenerateRequest:
    """One Generate request for the clip: `Input.transcription` (the bytes as they came, the language, the task,
    the prompt, Whisper's timestamp tokens for a format that shows times, its temperature fallback where the form's
    temperature is unset or 0 and it does not stream) and the form's sampling, greedy unless `temperature` is set;
    log-probabilities when the answer shows them (include logprobs) or is made of them (verbose_json's segments'
    avg_logprob).
    400 as `check_form`."""
    check_form(form)
    transcription = types_pb2.Transcription(audio=types_pb2.Audio(data=audio), language=form.language or "",
                                            task=TASKS[task], prompt=form.prompt,
                                            timestamps=form.response_format in TIMED_FORMATS and form.shows_segments,
                                            word_timestamps=form.shows_words,
                                            temperature_fallback=form.temperature_fallback and not form.temperature
                                            and not form.stream)
    sampling = types_pb2.SamplingParams(temperature=form.temperature if form.temperature is not None else 0.0,
                                        logprobs=form.want_logprobs or (form.response_format == "verbose_json"
                                                                        and form.shows_segments))
    if form.max_completion_tokens is not None:
        sampling.max_tokens = form.max_completion_tokens
    for name in _OPTIONAL_SAMPLING:
        if (value := getattr(form, name)) is not None:
            setattr(sampling, name, value)
    if form.seed is not None:
        sampling.seed = form.seed % ENGINE_SEEDS  # as chat's: OpenAI's seeds are int64, the engine's unsigned
    return engine_pb2.GenerateRequest(request_id=request_id, input=types_pb2.Input(transcription=transcription),
                                      sampling=sampling, cache_salt=cache_salt, adapter=adapter)


def form_param(param: str | None) -> str | None:
    """The form field an engine's refusal names (`ladle-param`: `transcription.language` -> `language`, the clip's
    `audio` -> `file`, `max_tokens` -> `max_completion_tokens`, `timestamps` (a model without timestamp tokens) ->
    `response_format`, `word_timestamps` (one without alignment heads) -> `timestamp_granularities`); other names
    unchanged, None stays None."""
    if param is None:
        return None
    name = param.removeprefix("input.").removeprefix("transcription.")
    return _FORM_PARAMS.get(name, name)


def token_usage(usage: types_pb2.Usage) -> dict[str, Any]:
    """OpenAI's token usage of a transcription."""
    return {"type": "tokens", "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def logprobs(entries: Any) -> list[dict[str, Any]]:
    """OpenAI's transcription logprobs (token, logprob, bytes) of the engine's TokenLogprob entries."""
    return [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token_bytes)} for e in entries]


def spoken_language(form: TranscriptionForm, task: Task, info: types_pb2.TranscriptionInfo) -> str:
    """verbose_json's `language`: English for a translation (what it is written in), else the engine's language
    (detected or the request's), by name."""
    if task == "translate":
        return ENGLISH
    return language_name(info.language or form.language or "")


def answer(
    form: TranscriptionForm, task: Task, reply: engine_pb2.GenerateResponse
) -> tuple[str | dict[str, Any], str]:
    """The body of the reply in the form's `response_format`, and its media type."""
    choice = reply.choices[0] if reply.choices else types_pb2.Choice()
    text = choice.text.strip()
    duration = reply.transcription.duration_seconds
    fmt = form.response_format
    if fmt == "text":
        return text + "\n", MEDIA_TYPES[fmt]
    if fmt in TIMED_FORMATS:
        found = segments(choice, duration, form.temperature or 0.0)
        if fmt == "srt":
            return "".join(f"{number}\n{_cue(s, ',')}" for number, s in enumerate(found, 1)), MEDIA_TYPES[fmt]
        if fmt == "vtt":
            return "WEBVTT\n\n" + "".join(_cue(s, ".") for s in found), MEDIA_TYPES[fmt]
        verbose: dict[str, Any] = {"task": task, "language": spoken_language(form, task, reply.transcription),
                                   "duration": duration, "text": text}
        if form.shows_segments:
            verbose["segments"] = found
        if form.shows_words:
            verbose["words"] = words(choice)
        verbose["usage"] = {"type": "duration", "seconds": duration}
        return verbose, MEDIA_TYPES[fmt]
    body: dict[str, Any] = {"text": text}
    if form.want_logprobs:
        body["logprobs"] = logprobs(choice.logprobs)
    body["usage"] = token_usage(reply.usage)
    return body, MEDIA_TYPES[fmt]


def words(choice: types_pb2.Choice) -> list[dict[str, Any]]:
    """verbose_json's words: each of the engine's (Choice.words), its text without the space before it, as
    whisper-1 writes them."""
    return [{"word": w.word.strip(), "start": w.start_seconds, "end": w.end_seconds} for w in choice.words]


def segments(choice: types_pb2.Choice, duration: float, temperature: float) -> list[dict[str, Any]]:
    """verbose_json's segments of a choice: one per engine segment, its temperature and no-speech probability the
    engine's, and as Whisper writes them its window's avg_logprob (the mean of Choice.logprobs over the window's
    tokens, its end token included; None where none came) and compression ratio (of the window's text): a window's
    segments are those of one `seek`, its tokens from its first segment's `first_token` to the next window's. The
    fallback, for an engine that answers text without segments (it ignores timestamps): one segment from 0 to the
    clip's duration over the whole choice at `temperature` (the form's); no text and no segments: none."""
    found = [e.logprob for e in choice.logprobs]
    if not choice.segments:
        if not choice.text:
            return []
        return [_segment(0, 0, 0.0, duration, choice.text, list(choice.token_ids), found, choice.text, temperature)]
    windows = [list(group) for _, group in itertools.groupby(choice.segments, key=lambda s: s.seek)]
    starts = [window[0].first_token for window in windows] + [len(choice.token_ids)]
    answered: list[dict[str, Any]] = []
    for window, start, end in zip(windows, starts, starts[1:], strict=False):
        text = "".join(s.text for s in window)
        answered += [_segment(len(answered) + i, s.seek, s.start_seconds, s.end_seconds, s.text, list(s.token_ids),
                              found[start:end], text, round(s.temperature, 6),
                              s.no_speech_prob if s.HasField("no_speech_prob") else None)
                     for i, s in enumerate(window)]  # fmt: skip
    return answered


def _segment(index: int, seek: int, start: float, end: float, text: str, tokens: list[int], found: list[float],
             window_text: str, temperature: float, no_speech_prob: float | None = None) -> dict[str, Any]:
    """One of verbose_json's segments, as whisper-1 writes it; `found`: its window's tokens' log-probabilities,
    `window_text`: its window's text."""
    return {"id": index, "seek": seek, "start": start, "end": end, "text": text, "tokens": tokens,
            "temperature": temperature, "avg_logprob": sum(found) / len(found) if found else None,
            "compression_ratio": compression_ratio(window_text), "no_speech_prob": no_speech_prob}


def _cue(segment: dict[str, Any], decimal: str) -> str:
    """A segment's srt or vtt cue (its number, for srt, written before it): its times and its trimmed text, any "-->"
    in it written "->" (the cue's own arrow), as Whisper's writers do."""
    text = segment["text"].strip().replace("-->", "->")
    return f"{_clock(segment['start'], decimal)} --> {_clock(segment['end'], decimal)}\n{text}\n\n"


def compression_ratio(text: str) -> float:
    """Whisper's measure of a repetitive decode: the text's UTF-8 bytes over their zlib-compressed length."""
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0


def _clock(seconds: float, decimal: str) -> str:
    """HH:MM:SS,mmm (SRT, `decimal` ",") or HH:MM:SS.mmm (WebVTT)."""
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    whole, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{whole:02d}{decimal}{millis:03d}"


def delta_event(text: str, entries: Any, want_logprobs: bool) -> dict[str, Any]:
    """A stream's `transcript.text.delta` event for the engine's new text (and its logprobs, when asked)."""
    event: dict[str, Any] = {"type": "transcript.text.delta", "delta": text}
    if want_logprobs:
        event["logprobs"] = logprobs(entries)
    return event


def done_event(text: str, usage: types_pb2.Usage, entries: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A stream's last event, `transcript.text.done`: the whole text (trimmed), its usage, and every logprob
    (None: not asked for)."""
    event: dict[str, Any] = {"type": "transcript.text.done", "text": text.strip()}
    if entries is not None:
        event["logprobs"] = entries
    event["usage"] = token_usage(usage)
    return event
