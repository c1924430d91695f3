"""OpenAI's speech-to-text routes through the official openai SDK against the gateway app and the fake engine:
every response_format of /v1/audio/transcriptions and /v1/audio/translations (the engine's segments as verbose_json's
segments and srt / vtt cues), streams, the form's refusals and the engine's passed through in OpenAI's shape, auth,
projects, rate limits and usage; and that the engine receives exactly the Transcription (bytes, language, task,
prompt, timestamps) and sampling the form asks for. The pure pieces (the answers' shapes, the fallback for a reply
without segments, the engine's field names, routing's key) and the fake engine's segments are tested apart, first."""

from __future__ import annotations

import io
import json
import wave
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from openai.types.audio import TranscriptionTextDeltaEvent, TranscriptionTextDoneEvent

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.routing import CHUNK_BYTES, clip_key, input_bytes, prefix_hashes
from gateway.schemas.audio import TranscriptionForm
from gateway.translate import transcriptions
from gateway.translate.languages import LANGUAGE_NAMES, language_name
from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.unit.fake_engine import (
    MODEL,
    NO_SPEECH_PROB,
    FakeEngine,
    clip_seconds,
    gateway_client,
    heard_text,
    start_fake_engine,
)
from tests.unit.test_gateway_audio import MP3, wav

CLIP = wav(1.5)  # 1.5 s of 16 kHz mono WAV: 48,044 bytes
TRANSCRIBE, TRANSLATE = types_pb2.TRANSCRIPTION_TASK_TRANSCRIBE, types_pb2.TRANSCRIPTION_TASK_TRANSLATE


def silence(seconds: float, channels: int, rate: int) -> bytes:
    """A 16-bit WAV file of silence."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(bytes(int(seconds * rate) * channels * 2))
    return buffer.getvalue()


def heard(size: int = len(CLIP), verb: str = "heard", prompt: str = "") -> str:
    """The fake engine's words for a clip of `size` bytes, trimmed as the gateway answers them."""
    speech = types_pb2.Transcription(audio=types_pb2.Audio(data=b"x" * size), prompt=prompt,
                                     task=TRANSLATE if verb == "translated" else TRANSCRIBE)
    return heard_text(speech).strip()


def speech(data: bytes = CLIP, language: str = "", task: int = TRANSCRIBE, prompt: str = "", timestamps: bool = False,
           fallback: bool = True) -> types_pb2.Transcription:
    """The Transcription the gateway sends (`fallback`: Whisper's temperature fallback, asked by a form that neither
    sets a temperature nor streams)."""
    return types_pb2.Transcription(audio=types_pb2.Audio(data=data), language=language, task=task, prompt=prompt,
                                   timestamps=timestamps, temperature_fallback=fallback)


def greedy(**fields: Any) -> types_pb2.SamplingParams:
    return types_pb2.SamplingParams(temperature=0.0, **fields)


# --- the pure pieces ---


def reply(text: str = " Hello there.", duration: float = 2.5, language: str = "de") -> engine_pb2.GenerateResponse:
    """An engine's reply without segments (as one that ignores timestamps answers)."""
    result = engine_pb2.GenerateResponse(transcription=types_pb2.TranscriptionInfo(language=language,
                                                                                   duration_seconds=duration))
    result.choices.add(text=text, token_ids=[7, 8], logprobs=[types_pb2.TokenLogprob(token=" Hello", logprob=-1.0),
                                                             types_pb2.TokenLogprob(token=" there.", logprob=-0.5)])
    result.usage.prompt_tokens, result.usage.completion_tokens = 5, 2
    return result


def timed_reply(logprobs: bool = True) -> engine_pb2.GenerateResponse:
    """An engine's reply with two segments of an hour's clip, the second in a later window (its tokens from the
    fifth on); a log-probability per token (timestamp tokens' too), or none."""
    result = engine_pb2.GenerateResponse(transcription=types_pb2.TranscriptionInfo(language="de",
                                                                                   duration_seconds=3725.25))
    found = [-0.1, -1.0, -0.5, -0.1, -0.2, -2.0, -0.3]
    result.choices.add(text=" Hello there. Bye.", token_ids=[50364, 7, 8, 50414, 50365, 9, 51000],
                       logprobs=[types_pb2.TokenLogprob(logprob=f) for f in found] if logprobs else [], segments=[
        types_pb2.TranscriptionSegment(start_seconds=0.0, end_seconds=1.0, text=" Hello there.",
                                       token_ids=[50364, 7, 8, 50414], first_token=0, seek=0, temperature=0.2,
                                       no_speech_prob=0.25),
        types_pb2.TranscriptionSegment(start_seconds=3600.5, end_seconds=3725.25, text=" Bye.",
                                       token_ids=[50365, 9, 51000], first_token=4, seek=360_000, temperature=0.5)])
    return result


def test_each_timed_format_answers_the_engines_segments() -> None:
    def answer(fmt: Any, logprobs: bool = True, **fields: Any) -> Any:
        return transcriptions.answer(TranscriptionForm(response_format=fmt, **fields), "transcribe",
                                     timed_reply(logprobs))

    assert answer("srt") == ("1\n00:00:00,000 --> 00:00:01,000\nHello there.\n\n"
                             "2\n01:00:00,500 --> 01:02:05,250\nBye.\n\n", "application/x-subrip")
    assert answer("vtt") == ("WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nHello there.\n\n"
                             "01:00:00.500 --> 01:02:05.250\nBye.\n\n", "text/vtt")
    assert answer("text") == ("Hello there. Bye.\n", "text/plain")
    arrow = timed_reply(True)
    arrow.choices[0].segments[0].text = " A --> B"
    assert transcriptions.answer(TranscriptionForm(response_format="srt"), "transcribe", arrow)[0].startswith(
        "1\n00:00:00,000 --> 00:00:01,000\nA -> B\n\n")  # (a cue's text never holds the cue's arrow)
    verbose, _ = answer("verbose_json")
    assert verbose["text"] == "Hello there. Bye." and verbose["duration"] == 3725.25
    first, second = verbose["segments"]
    assert first == {"id": 0, "seek": 0, "start": 0.0, "end": 1.0, "text": " Hello there.",
                     "tokens": [50364, 7, 8, 50414], "temperature": 0.2, "avg_logprob":
                     pytest.approx(-0.425), "compression_ratio": transcriptions.compression_ratio(" Hello there."),
                     "no_speech_prob": pytest.approx(0.25)}  # (the engine's temperature and silence, as measured)
    assert (second["id"], second["seek"], second["start"], second["end"], second["text"], second["tokens"],
            second["temperature"], second["no_speech_prob"]) == (1, 360_000, 3600.5, 3725.25, " Bye.",
                                                                 [50365, 9, 51000], 0.5, None)  # fmt: skip
    assert second["avg_logprob"] == pytest.approx(-2.5 / 3)  # its window's tokens' logprobs, from its first token on
    assert second["compression_ratio"] == transcriptions.compression_ratio(" Bye.")
    assert [s["avg_logprob"] for s in answer("verbose_json", logprobs=False)[0]["segments"]] == [None, None]


def test_a_reply_without_segments_answers_one_segment_over_the_clip() -> None:
    def answer(fmt: Any, task: Any = "transcribe", text: str = " Hello there.", **fields: Any) -> Any:
        return transcriptions.answer(TranscriptionForm(response_format=fmt, **fields), task,
                                     reply(text, duration=3725.25))

    assert answer("json") == ({"text": "Hello there.", "usage": {"type": "tokens", "input_tokens": 5,
                                                                 "output_tokens": 2, "total_tokens": 7}},
                              "application/json")
    assert answer("text") == ("Hello there.\n", "text/plain")
    assert answer("srt") == ("1\n00:00:00,000 --> 01:02:05,250\nHello there.\n\n", "application/x-subrip")
    assert answer("vtt") == ("WEBVTT\n\n00:00:00.000 --> 01:02:05.250\nHello there.\n\n", "text/vtt")
    verbose, _ = answer("verbose_json", temperature=0.2)
    assert verbose["task"] == "transcribe" and verbose["language"] == "german" and verbose["duration"] == 3725.25
    assert verbose["segments"] == [{
        "id": 0, "seek": 0, "start": 0.0, "end": 3725.25, "text": " Hello there.", "tokens": [7, 8],
        "temperature": 0.2, "avg_logprob": -0.75, "compression_ratio": transcriptions.compression_ratio(
            " Hello there."), "no_speech_prob": None}]
    assert verbose["usage"] == {"type": "duration", "seconds": 3725.25}
    assert answer("verbose_json", "translate")[0]["language"] == "english"  # what a translation is written in
    with_logprobs, _ = answer("json", include=["logprobs"])
    assert with_logprobs["logprobs"] == [{"token": " Hello", "logprob": -1.0, "bytes": []},
                                         {"token": " there.", "logprob": -0.5, "bytes": []}]
    # No text and no segments (silence): no segment, no cue.
    assert answer("verbose_json", text="")[0]["segments"] == []
    assert answer("srt", text="") == ("", "application/x-subrip")
    assert answer("vtt", text="") == ("WEBVTT\n\n", "text/vtt")


def test_languages_are_named_as_openai_names_them() -> None:
    assert len(LANGUAGE_NAMES) == 100 and language_name("EN") == "english" and language_name("yue") == "cantonese"
    assert language_name("german") == "german" and language_name("xx") == "xx"
    assert transcriptions.compression_ratio("") == 0.0
    assert transcriptions.compression_ratio("ab " * 100) > 10 > transcriptions.compression_ratio("abc") > 0


def test_the_engines_field_names_become_the_forms() -> None:
    assert [transcriptions.form_param(p) for p in ("transcription.audio", "input.transcription.audio.data",
                                                   "transcription.language", "transcription.prompt", "input",
                                                   "max_tokens", "temperature", "input.transcription.timestamps",
                                                   "input.transcription.word_timestamps", None)] == [
        "file", "file", "language", "prompt", "file", "max_completion_tokens", "temperature", "response_format",
        "timestamp_granularities", None]


def test_a_transcription_is_routed_by_its_clip_then_its_task_language_and_prompt() -> None:
    key = input_bytes(types_pb2.Input(transcription=speech(language="de", prompt="p")))
    assert key.startswith(clip_key(CLIP)) and key != input_bytes(types_pb2.Input(transcription=speech(language="fr")))
    assert input_bytes(types_pb2.Input(transcription=speech())) == clip_key(CLIP) + b"\x001\x00\x00"
    assert len(clip_key(CLIP)) == CHUNK_BYTES and clip_key(CLIP) != clip_key(MP3)
    assert len(prefix_hashes(input_bytes(types_pb2.Input(transcription=speech())))) == 1  # a clip is one chunk


def test_the_routes_document_openais_form_and_every_answer() -> None:
    document = create_app(GatewayConfig(engines=("127.0.0.1:1",))).openapi()
    for route in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        operation = document["paths"][route]["post"]
        body = operation["requestBody"]["content"]["multipart/form-data"]["schema"]
        assert body["required"] == ["file"] and body["properties"]["file"]["format"] == "binary"
        assert body["properties"]["temperature"] == {"type": "number", "minimum": 0.0, "maximum": 2.0,
                                                     "title": "Temperature"}  # absent rather than null in a form
        assert {"timestamp_granularities[]", "include[]", "seed", "max_completion_tokens"} <= set(body["properties"])
        assert set(operation["responses"]["200"]["content"]) == {
            "application/json", "text/plain", "application/x-subrip", "text/vtt", "text/event-stream"}


def test_the_fake_engine_reads_a_wav_clips_length() -> None:
    assert clip_seconds(CLIP) == 1.5 and clip_seconds(b"x" * 64_000) == 2.0


async def test_the_fake_engines_segments_keep_the_engines_rules(fake: tuple[FakeEngine, str]) -> None:
    """With timestamps: segments in order over the clip, their tokens the choice's in order from `first_token`, a
    logprob a token, the text their texts; a stream's tokens the same, its segments on the last delta. Without: as
    before, no segments."""
    sampling = types_pb2.SamplingParams(logprobs=True)
    request = engine_pb2.GenerateRequest(input=types_pb2.Input(transcription=speech(prompt="one two three",
                                                                                    timestamps=True)),
                                         sampling=sampling)
    async with grpc.aio.insecure_channel(fake[1]) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        choice = (await stub.Generate(request)).choices[0]
        streamed = [m.choices[0] async for m in stub.Stream(engine_pb2.StreamRequest(input=request.input,
                                                                                      sampling=sampling))]
        plain = (await stub.Generate(engine_pb2.GenerateRequest(input=types_pb2.Input(transcription=speech()),
                                                                sampling=sampling))).choices[0]
    found = list(choice.segments)
    assert len(found) == 4 and choice.text == "".join(s.text for s in found) == " " + heard(prompt="one two three")
    assert [t for s in found for t in s.token_ids] == list(choice.token_ids) == [e.token_id for e in choice.logprobs]
    assert [s.first_token for s in found] == [0, 4, 8, 12] and {s.seek for s in found} == {0}
    assert [(s.start_seconds, s.end_seconds) for s in found] == [(0.0, 0.375), (0.375, 0.75), (0.75, 1.125),
                                                                  (1.125, 1.5)]
    assert found[1].token_ids[0] == found[0].token_ids[-1] == 1000 + round(0.375 / 0.02)  # timestamp tokens
    assert [d.segments for d in streamed[:-1]] == [[]] and list(streamed[-1].segments) == found
    assert [t for d in streamed for t in d.token_ids] == list(choice.token_ids)
    assert "".join(d.text for d in streamed) == choice.text
    assert not plain.segments and list(plain.token_ids) == [100, 101, 102] and len(plain.logprobs) == 3


async def test_the_fake_engine_refuses_a_fallback_that_is_not_greedy(fake: tuple[FakeEngine, str]) -> None:
    """As the engine: Whisper's temperature fallback with a sampling temperature other than 0 is INVALID_ARGUMENT
    naming `temperature`; at 0 its segments carry the temperature and the window's no-speech probability."""
    timed = types_pb2.Input(transcription=speech(timestamps=True))
    async with grpc.aio.insecure_channel(fake[1]) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            hot = types_pb2.SamplingParams(temperature=0.5)
            await stub.Generate(engine_pb2.GenerateRequest(input=timed, sampling=hot))
        fell_back = (await stub.Generate(engine_pb2.GenerateRequest(input=timed, sampling=greedy()))).choices[0]
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature must be 0" in str(
        refused.value.details())
    assert dict(refused.value.trailing_metadata() or ())["ladle-param"] == "temperature"
    assert {(s.temperature, s.no_speech_prob) for s in fell_back.segments} == {(0.0, NO_SPEECH_PROB)}


# --- the routes, through the SDK ---


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeEngine, str]]:
    engine = FakeEngine(max_clip_s=30.0)  # (as an engine run with --max-transcription-seconds 30)
    grpc_server, address = await start_fake_engine(engine)
    yield engine, address
    await grpc_server.stop(None)


def sdk(http: httpx.AsyncClient, key: str = "x") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, http_client=http, max_retries=0)


async def test_a_transcription_in_every_format(fake: tuple[FakeEngine, str], tmp_path: Path) -> None:
    engine = fake[0]
    async with gateway_client(fake[1], tmp_path) as http:
        client = sdk(http)
        whole = await client.audio.transcriptions.create(model=MODEL, file=("clip.wav", CLIP, "audio/wav"))
        assert whole.text == heard() and whole.usage is not None and whole.usage.type == "tokens"
        assert (whole.usage.input_tokens, whole.usage.output_tokens, whole.usage.total_tokens) == (4, 3, 7)
        assert engine.heard[-1] == (speech(), greedy())  # greedy, nothing else set: the engine's own defaults
        text = await client.audio.transcriptions.create(model=MODEL, file=CLIP, response_format="text")
        assert text == heard() + "\n"
        srt = await client.audio.transcriptions.create(model=MODEL, file=CLIP, response_format="srt")
        assert srt == "1\n00:00:00,000 --> 00:00:00,750\nheard 48044\n\n2\n00:00:00,750 --> 00:00:01,500\nbytes\n\n"
        vtt = await client.audio.transcriptions.create(model=MODEL, file=CLIP, response_format="vtt")
        assert vtt == "WEBVTT\n\n00:00:00.000 --> 00:00:00.750\nheard 48044\n\n00:00:00.750 --> 00:00:01.500\nbytes\n\n"
        verbose = await client.audio.transcriptions.create(model=MODEL, file=CLIP, response_format="verbose_json",
                                                           language="de", prompt="Ladle, Whisper.",
                                                           timestamp_granularities=["segment"])
        assert (verbose.language, verbose.duration, verbose.text) == ("german", 1.5, heard(prompt="Ladle, Whisper."))
        # Timestamps asked, and logprobs for the segments' avg_logprob.
        assert engine.heard[-1] == (speech(language="de", prompt="Ladle, Whisper.", timestamps=True),
                                    greedy(logprobs=True))
        assert verbose.segments is not None
        assert [(s.id, s.seek, s.start, s.end, s.text, s.tokens) for s in verbose.segments] == [
            (0, 0, 0.0, 0.5, " heard 48044", [1000, 100, 101, 1025]),
            (1, 0, 0.5, 1.0, " bytes after", [1025, 102, 103, 1050]),
            (2, 0, 1.0, 1.5, " Ladle, Whisper.", [1050, 104, 105, 1075])]
        # As Whisper writes them, each segment's avg_logprob and compression ratio are its window's: the mean over the
        # window's tokens, its words' (-0.25 a word on) and its timestamps' (-0.125 each), and its whole text's.
        assert [s.avg_logprob for s in verbose.segments] == pytest.approx([-0.5] * 3)
        assert [(s.temperature, s.no_speech_prob) for s in verbose.segments] == [(0.0, NO_SPEECH_PROB)] * 3
        assert [s.compression_ratio for s in verbose.segments] == [
            transcriptions.compression_ratio(" heard 48044 bytes after Ladle, Whisper.")] * 3
        detected = await client.audio.transcriptions.create(model=MODEL, file=MP3, response_format="verbose_json")
        assert detected.language == "english"  # the fake "detects" English when no language is given
        assert engine.heard[-1][0].audio.data == MP3  # passed on as it came: the engine decodes


@pytest.mark.parametrize(("fmt", "timestamps"), [("json", False), ("text", False), ("verbose_json", True),
                                                 ("srt", True), ("vtt", True)])
async def test_the_formats_that_show_times_ask_the_engine_for_timestamps(
    fake: tuple[FakeEngine, str], tmp_path: Path, fmt: Any, timestamps: bool
) -> None:
    async with gateway_client(fake[1], tmp_path) as http:
        await sdk(http).audio.transcriptions.create(model=MODEL, file=CLIP, response_format=fmt)
        await sdk(http).audio.translations.create(model=MODEL, file=CLIP, response_format=fmt)
    assert [transcription.timestamps for transcription, _ in fake[0].heard] == [timestamps, timestamps]


@pytest.mark.parametrize(("granularities", "segments", "words"), [
    (None, True, False), (["segment"], True, False), (["word"], False, True), (["word", "segment"], True, True),
])  # fmt: skip
async def test_verbose_json_answers_the_granularities_asked(
    fake: tuple[FakeEngine, str], tmp_path: Path, granularities: list[str] | None, segments: bool, words: bool
) -> None:
    """As whisper-1: `word` asks the engine's word timings and answers `words` (each word's text trimmed, its times the
    engine's); `segment`, or no granularity, asks timestamps and answers `segments`; `word` alone answers none (and
    does not ask timestamps)."""
    extra = {} if granularities is None else {"timestamp_granularities": granularities}
    async with gateway_client(fake[1], tmp_path) as http:
        verbose = await sdk(http).audio.transcriptions.create(model=MODEL, file=CLIP, response_format="verbose_json",
                                                              **extra)  # fmt: skip
    (transcription, sampling), = fake[0].heard
    assert (transcription.timestamps, transcription.word_timestamps) == (segments, words)
    assert sampling.logprobs == segments  # (made into the segments' avg_logprob; words need none)
    assert (verbose.segments is not None, verbose.words is not None) == (segments, words)
    if words:
        assert verbose.words is not None
        assert [(w.word, w.start, w.end) for w in verbose.words] == [
            ("heard", 0.0, 0.5), (str(len(CLIP)), 0.5, 1.0), ("bytes", 1.0, 1.5)]  # (the fake's: trimmed)
    assert verbose.text == heard()


def test_the_answer_trims_each_words_text() -> None:
    """The pure answer: the engine's words (their leading space kept) answer trimmed, their times as they came."""
    result = reply(" Hello there.", duration=2.0)
    result.choices[0].words.extend([types_pb2.TranscriptionWord(word=" Hello", start_seconds=0.0, end_seconds=0.5),
                                    types_pb2.TranscriptionWord(word=" there.", start_seconds=0.5, end_seconds=1.25)])
    body, _ = transcriptions.answer(TranscriptionForm(response_format="verbose_json",
                                                      timestamp_granularities=["word"]), "transcribe", result)
    assert isinstance(body, dict) and "segments" not in body
    assert body["words"] == [{"word": "Hello", "start": 0.0, "end": 0.5}, {"word": "there.", "start": 0.5, "end": 1.25}]


@pytest.mark.parametrize(("fields", "fallback"), [
    ({}, True), ({"temperature": 0.0}, True), ({"temperature": 0.3}, False),
    ({"extra_body": {"temperature_fallback": False}}, False), ({"stream": True}, False),
])  # fmt: skip
async def test_a_form_at_temperature_0_asks_whispers_temperature_fallback(
    fake: tuple[FakeEngine, str], tmp_path: Path, fields: dict[str, Any], fallback: bool
) -> None:
    """As OpenAI documents whisper-1's temperature: unset or 0 decodes greedily, then hotter while the decode fails
    Whisper's checks; a temperature set decodes at it alone; a stream, and ladle's `temperature_fallback` false,
    once."""
    async with gateway_client(fake[1], tmp_path) as http:
        answer = await sdk(http).audio.transcriptions.create(model=MODEL, file=CLIP, **fields)
        if fields.get("stream"):
            _ = [event async for event in answer]  # type: ignore[union-attr]
    assert [transcription.temperature_fallback for transcription, _ in fake[0].heard] == [fallback]


async def test_the_engine_receives_exactly_the_forms_transcription_and_sampling(
    fake: tuple[FakeEngine, str], tmp_path: Path
) -> None:
    async with gateway_client(fake[1], tmp_path) as http:
        reply = await sdk(http).audio.transcriptions.create(
            model=MODEL, file=("talk.flac", CLIP), language="fr", prompt="Ladle, Whisper.", temperature=0.4,
            include=["logprobs"],
            extra_body={"seed": -1, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "max_completion_tokens": 40,
                        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
                        "chunking_strategy": "auto"})  # an option of other models: ignored, as unknown fields are
    assert fake[0].heard == [(
        speech(language="fr", prompt="Ladle, Whisper.", fallback=False),  # (a temperature set: decoded at it alone)
        types_pb2.SamplingParams(temperature=0.4, seed=2**63 - 1, top_p=0.9, top_k=5, min_p=0.1, max_tokens=40,
                                 presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, logprobs=True))]
    assert reply.text == heard(prompt="Ladle, Whisper.")
    assert reply.logprobs is not None and [lp.token for lp in reply.logprobs] == [
        " heard", f" {len(CLIP)}", " bytes", " after", " Ladle,", " Whisper."]
    assert reply.logprobs[0].logprob == -0.25 and reply.logprobs[0].bytes == list(b" heard")


async def test_translations_in_every_format(fake: tuple[FakeEngine, str], tmp_path: Path) -> None:
    async with gateway_client(fake[1], tmp_path) as http:
        client = sdk(http)
        whole = await client.audio.translations.create(model=MODEL, file=CLIP, prompt="Hi.")
        assert whole.text == heard(verb="translated", prompt="Hi.")
        assert fake[0].heard[-1] == (speech(task=TRANSLATE, prompt="Hi."), greedy())
        verbose = await client.audio.translations.create(model=MODEL, file=CLIP, response_format="verbose_json",
                                                         extra_body={"language": "de", "to_language": "en"})
        assert (verbose.language, verbose.duration) == ("english", 1.5)  # the language of what it wrote
        assert fake[0].heard[-1][0] == speech(language="de", task=TRANSLATE, timestamps=True)  # vLLM's extra
        assert await client.audio.translations.create(model=MODEL, file=CLIP, response_format="text") == \
            heard(verb="translated") + "\n"
        srt = await client.audio.translations.create(model=MODEL, file=CLIP, response_format="srt")
        assert srt == ("1\n00:00:00,000 --> 00:00:00,750\ntranslated 48044\n\n"
                       "2\n00:00:00,750 --> 00:00:01,500\nbytes\n\n")
        assert fake[0].heard[-1][0] == speech(task=TRANSLATE, timestamps=True)
        with pytest.raises(openai.BadRequestError) as bad:
            await client.audio.translations.create(model=MODEL, file=CLIP, extra_body={"to_language": "de"})
        assert bad.value.param == "to_language" and "English only" in bad.value.message


async def test_a_stream_sends_text_deltas_then_the_whole_text_with_usage(
    fake: tuple[FakeEngine, str], tmp_path: Path
) -> None:
    async with gateway_client(fake[1], tmp_path) as http:
        client = sdk(http)
        stream = await client.audio.transcriptions.create(model=MODEL, file=CLIP, stream=True, language="es",
                                                          include=["logprobs"])
        *events, done = [event async for event in stream]
        deltas = [e for e in events if isinstance(e, TranscriptionTextDeltaEvent)]
        assert len(deltas) == len(events) == 2 and isinstance(done, TranscriptionTextDoneEvent)
        assert "".join(e.delta for e in deltas) == done.text == heard()  # the leading space trimmed, as whole
        assert done.usage is not None and (done.usage.input_tokens, done.usage.output_tokens) == (4, 3)
        assert done.logprobs is not None and len(done.logprobs) == 3
        assert [len(e.logprobs or []) for e in deltas] == [1, 2]
        assert fake[0].heard[-1] == (speech(language="es", fallback=False), greedy(logprobs=True))  # (decoded once)
        translated = await client.audio.translations.create(model=MODEL, file=CLIP, response_format="text",
                                                            extra_body={"stream": True})
        assert isinstance(translated, str)  # the SDK does not stream translations: the raw events
        events_raw = [json.loads(line[6:]) for line in translated.splitlines() if line.startswith("data: {")]
        assert events_raw[-1]["type"] == "transcript.text.done" and translated.rstrip().endswith("data: [DONE]")
        assert events_raw[-1]["text"] == heard(verb="translated") and "logprobs" not in events_raw[-1]


async def test_a_stream_the_engine_refuses_is_an_http_error(fake: tuple[FakeEngine, str], tmp_path: Path) -> None:
    async with gateway_client(fake[1], tmp_path) as http:
        with pytest.raises(openai.BadRequestError) as bad:
            await sdk(http).audio.transcriptions.create(model=MODEL, file=CLIP, stream=True, language="klingon")
    assert bad.value.status_code == 400 and bad.value.param == "language"


async def test_a_stream_cut_after_its_first_text_ends_with_an_error_event(tmp_path: Path) -> None:
    engine = FakeEngine(unavailable=True, unavailable_after_output=True)
    grpc_server, address = await start_fake_engine(engine)
    try:
        async with gateway_client(address, tmp_path) as http:
            stream = await sdk(http).audio.transcriptions.create(model=MODEL, file=CLIP, stream=True)
            received = []
            with pytest.raises(openai.APIError, match="the engine is unavailable"):
                async for event in stream:
                    received.append(event)
            metrics = (await http.get("/metrics")).text
    finally:
        await grpc_server.stop(None)
    assert [e.type for e in received] == ["transcript.text.delta"]  # what came before the engine went away
    assert 'ladle_gateway_usage_tokens_total{kind="interactive",model="fake-model",project="default",type="output"} ' \
        '1.0' in metrics  # billed for what was sent


def form(fields: dict[str, str], file: bytes | None = CLIP) -> dict[str, Any]:
    """httpx's multipart arguments for a form of these text fields and this clip (None: the clip in a part named
    otherwise)."""
    part = ("file", file) if file is not None else ("audio", CLIP)
    return {"data": fields, "files": {part[0]: ("clip.wav", part[1])}}


@pytest.mark.parametrize(("fields", "file", "param", "says"), [
    ({"model": MODEL}, None, "file", "no `file` part"),
    ({"model": MODEL}, b"", "file", "empty"),
    ({"response_format": "diarized_json"}, CLIP, "response_format", "verbose_json"),
    ({"timestamp_granularities[]": "word"}, CLIP, "timestamp_granularities", "verbose_json only"),
    ({"timestamp_granularities[]": "word", "response_format": "srt"}, CLIP, "timestamp_granularities",
     "verbose_json only"),
    ({"include[]": "confidence"}, CLIP, "include", "'confidence' is not available"),
    ({"include[]": "logprobs", "response_format": "text"}, CLIP, "include", "json only"),
    ({"stream": "true", "response_format": "srt"}, CLIP, "stream", "json or text"),
    ({"temperature": "3"}, CLIP, "temperature", "less than or equal to 2"),
    ({"stream": "perhaps"}, CLIP, "stream", "boolean"),
    ({"language": "klingon"}, CLIP, "language", "unknown language 'klingon'"),  # the engine's, passed through
    ({"model": MODEL}, wav(31.0), "file", "the audio clip is 31.0 s long; this model hears at most 30 s"),
])
async def test_the_form_and_the_engine_refuse_in_openais_shape(
    fake: tuple[FakeEngine, str], tmp_path: Path, fields: dict[str, str], file: bytes | None, param: str, says: str
) -> None:
    async with gateway_client(fake[1], tmp_path) as http:
        reply = await http.post("/v1/audio/transcriptions", **form(fields, file))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and says in error["message"]


async def test_bodies_that_are_no_form_or_too_large(fake: tuple[FakeEngine, str], tmp_path: Path) -> None:
    async with gateway_client(fake[1], tmp_path, max_audio_bytes=50_000, max_request_bytes=1000) as http:
        # The clip is capped by --max-audio-mib, not by the (smaller) request limit.
        assert (await http.post("/v1/audio/transcriptions", **form({}))).status_code == 200
        too_large = await http.post("/v1/audio/transcriptions", **form({}, wav(2.0)))
        assert too_large.status_code == 413 and too_large.json()["error"]["param"] == "file"
        assert "50000 bytes" in too_large.json()["error"]["message"]
        not_a_form = await http.post("/v1/audio/translations", json={"file": "clip.wav"})
        assert not_a_form.status_code == 400 and "multipart/form-data" in not_a_form.json()["error"]["message"]
        twice = await http.post("/v1/audio/transcriptions", data={"language": ["en", "de"]},
                                files={"file": ("a.wav", CLIP)})
        assert twice.status_code == 400 and twice.json()["error"]["param"] == "language"
        unknown = await http.post("/v1/audio/transcriptions", **form({"model": "whisper-1"}))
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        two = await http.post("/v1/audio/transcriptions", files=[("file", ("a.wav", CLIP)), ("file", ("b.wav", CLIP))])
        assert two.status_code == 400 and "one `file` part" in two.json()["error"]["message"]
        # Without a Content-Length (chunked), the body is capped as it arrives.
        for clip, status in ((CLIP, 200), (wav(2.0), 413)):
            encoded = httpx.Request("POST", "http://gw", files={"file": ("a.wav", clip)})
            chunked = await http.post("/v1/audio/transcriptions", content=chunks(encoded.read()),
                                      headers={"Content-Type": encoded.headers["Content-Type"]})
            assert chunked.status_code == status, chunked.text
    assert len(fake[0].heard) == 2


async def chunks(body: bytes, size: int = 8192) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start:start + size]


async def test_a_clip_up_to_the_audio_cap_reaches_the_engine_whole(tmp_path: Path) -> None:
    engine = FakeEngine()
    grpc_server, address = await start_fake_engine(engine, max_message_bytes=64 * 1024 * 1024)  # the engine's
    big = silence(25.0, channels=2, rate=48_000)  # 4.8 MB: more than grpc's default 4 MiB message, within 30 s
    try:
        async with gateway_client(address, tmp_path, max_audio_bytes=len(big)) as http:
            reply = await sdk(http).audio.transcriptions.create(model=MODEL, file=("long.wav", big),
                                                                response_format="verbose_json")
    finally:
        await grpc_server.stop(None)
    assert engine.heard[0][0].audio.data == big and (reply.text, reply.duration) == (heard(len(big)), 25.0)


async def test_a_model_that_does_not_transcribe_refuses_a_clip(tmp_path: Path) -> None:
    engine = FakeEngine(transcribes=False)
    grpc_server, address = await start_fake_engine(engine)
    try:
        async with gateway_client(address, tmp_path) as http:
            with pytest.raises(openai.BadRequestError) as bad:
                await sdk(http).audio.translations.create(model=MODEL, file=CLIP)
    finally:
        await grpc_server.stop(None)
    assert bad.value.param == "file" and "does not transcribe" in bad.value.message


async def test_a_speech_to_text_engine_refuses_a_chat(tmp_path: Path) -> None:
    engine = FakeEngine(speech_only=True)
    grpc_server, address = await start_fake_engine(engine)
    try:
        async with gateway_client(address, tmp_path) as http:
            chat = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
                {"role": "user", "content": "hi"}]})
            heard_ok = await http.post("/v1/audio/transcriptions", **form({}))
    finally:
        await grpc_server.stop(None)
    assert chat.status_code == 400 and "speech-to-text" in chat.json()["error"]["message"]
    assert heard_ok.status_code == 200 and heard_ok.json()["text"] == heard()


async def test_keys_projects_rate_limits_usage_and_request_ids(fake: tuple[FakeEngine, str], tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-alpha alpha\nsk-admin default admin\n")
    limits = tmp_path / "limits"
    limits.write_text("alpha requests_per_minute=2\n")
    async with gateway_client(fake[1], tmp_path, api_keys_file=keys, rate_limits_file=limits) as http:
        with pytest.raises(openai.AuthenticationError):
            await sdk(http, "sk-wrong").audio.transcriptions.create(model=MODEL, file=CLIP)
        raw = await sdk(http, "sk-alpha").audio.transcriptions.with_raw_response.create(
            model=MODEL, file=CLIP, extra_headers={"X-Request-Id": "call-7"})
        assert raw.headers["x-request-id"] == "call-7" and raw.headers["x-ratelimit-remaining-requests"] == "1"
        assert raw.parse().text == heard()
        await sdk(http, "sk-alpha").audio.translations.create(model=MODEL, file=CLIP)
        with pytest.raises(openai.RateLimitError):
            await sdk(http, "sk-alpha").audio.transcriptions.create(model=MODEL, file=CLIP)
        metrics = (await http.get("/metrics", headers={"Authorization": "Bearer sk-admin"})).text
    assert len(fake[0].heard) == 2
    assert 'ladle_gateway_usage_requests_total{kind="interactive",model="fake-model",project="alpha"} 2.0' in metrics
    assert 'ladle_gateway_usage_tokens_total{kind="interactive",model="fake-model",project="alpha",type="output"} ' \
        '6.0' in metrics
    for route in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        assert f'route="{route}",status="200"' in metrics

