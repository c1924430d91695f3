"""A fake EngineService on a loopback gRPC server, for unit tests of the gateway's batch machinery.

It answers health (SERVING), GetModelInfo and GetLoad like an engine, and Generate, Stream and Batch by echoing:
the reply's text is the request's last chat message (or prompt) upper-cased (a stream sends it in two chunks).
Tokenize answers one token id per character of text, per image and per audio clip (`_tokens`).
Embed answers each input with `fake_vector` (DIMENSIONS values from a hash of the input, truncated to `dimensions`,
normalized unless `normalize` is false; one token per character or id) and Score with the cosine similarity of the
query's and each document's vector; Batch answers `embed` and `score` items likewise.
A chat turn's `content_parts` echo as their text with each image as `<image N>` and each audio clip as `<audio N>`
(N its bytes); the engine's rules for them hold (INVALID_ARGUMENT naming `messages[i].content...`: `content` and
`content_parts` both set, a part with neither text, an image nor audio, an image when `reads_images` is false, a clip
when `reads_audio` is false, as a model without that tower refuses it), and every image received is kept in
`images`, every clip in `audio`.
An `Input.transcription` is heard as a speech-to-text engine hears it, under its rules (INVALID_ARGUMENT naming the
field: no clip, a clip longer than `max_clip_s` (MAX_CLIP_S, the engine's default), a language not in
FAKE_LANGUAGES by code or name, an unknown task; a
transcription when `transcribes` is false, as a text model refuses it, and any other input when `speech_only`, as a
Whisper engine refuses it): its reply is `heard_text` (the task's verb and the clip's size) with one token per
word, the logprobs when asked, and TranscriptionInfo (the request's language as a code, or "en" as if detected; the
clip's duration, read from a WAV header, else 16-bit mono 16 kHz); every transcription received is kept, with its
sampling, in `heard`. With `Transcription.timestamps` the choice carries segments as the engine's do: two words
each, their times spread evenly over the clip, each segment's tokens its words' between two timestamp tokens
(TIMESTAMP_ID + round(t / 0.02), no text), so the choice's token ids (and logprobs, one a token) are its segments'
tokens in order and each segment's `first_token` is where they start; the text is the words alone either way. A
stream sends its tokens in two messages, the info on the first, the segments on the last. Under
`Transcription.temperature_fallback` (refused unless the sampling's temperature is 0, as the engine refuses it) the
first decode passes Whisper's check: the answer is as without, its segments at temperature 0 with NO_SPEECH_PROB.
With `Transcription.word_timestamps` the choice (a stream's last delta) carries a word each of its words, each over an
equal share of the clip in order.
It keeps the real engine's rules for a Batch call: an item id must be non-empty and unique within the call
(else the item fails INVALID_ARGUMENT, as engine_server.server.servicer answers), and the call reads at most
2 x `max_num_seqs` items ahead of its answers (the engine's intake window; the caller's further items wait).
Tests script failures through `FakeEngine`: `refuse_once` (RESOURCE_EXHAUSTED the first time a text is seen),
`invalid` (INVALID_ARGUMENT for a text), `abort_once` (a result with finish reason ABORT the first time a text is
seen, as a draining engine answers), `die_after` (a Batch call ends UNAVAILABLE after that many results),
`die_after_s` (the next Batch call ends UNAVAILABLE after that many seconds, whatever it is doing), `kill_calls()`
(every running Batch call ends UNAVAILABLE now), `unavailable` (every Generate / Stream / Embed / Score / Batch
call fails UNAVAILABLE, a Batch call before it reads an item; a stream after its first chunk when
`unavailable_after_output`), `delay_s` per item, and poison: `oversize` (the call fails RESOURCE_EXHAUSTED with
grpc's "message larger than max" as the item with that text is answered, as a reply over the message limit
does) and `break_call` (the call fails INTERNAL whenever an item with that text arrives).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import hashlib
import io
import math
import wave
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2

MODEL = "fake-model"
DIMENSIONS = 8  # length of the fake engine's embeddings
MAX_CLIP_S = 3600.0  # the engine's --max-transcription-seconds default: longer clips are refused (shorter ones past
# Whisper's 30 s window are transcribed in windows)
FAKE_LANGUAGES = {"en": "english", "de": "german", "fr": "french", "es": "spanish", "ja": "japanese"}
WORD_ID = 100  # the fake's token id of a transcription's first word; word i is WORD_ID + i
TIMESTAMP_ID = 1000  # the fake's `<|0.00|>` (above its word ids); `<|t|>` is TIMESTAMP_ID + round(t / 0.02)
SEGMENT_WORDS = 2  # words of a transcription's segment, when it asks for timestamps
NO_SPEECH_PROB = 0.125  # a segment's window's silence, measured under temperature fallback (its first decode passes)
Piece = tuple[str, int, types_pb2.TokenLogprob | None]  # a token of the fake's decode: (text, id, logprob if asked)


@dataclass
class FakeEngine(engine_pb2_grpc.EngineServiceServicer):
    max_num_seqs: int = 4
    delay_s: float = 0.0
    refuse_once: set[str] = field(default_factory=set)
    invalid: set[str] = field(default_factory=set)
    die_after: int | None = None  # results per call before it fails with UNAVAILABLE (once)
    die_after_s: float | None = None  # seconds into the next Batch call when it fails with UNAVAILABLE (once)
    abort_once: set[str] = field(default_factory=set)
    oversize: set[str] = field(default_factory=set)
    break_call: set[str] = field(default_factory=set)
    item_ids: list[str] = field(default_factory=list)  # every Batch item id received, over all calls
    cache_salts: Counter[str] = field(default_factory=Counter)  # the cache_salt of every Batch item received
    seen: Counter[str] = field(default_factory=Counter)  # item texts received, over all calls
    answered: Counter[str] = field(default_factory=Counter)  # results sent
    max_unanswered: int = 0  # most items of one call received and not yet answered, at any moment
    unanswered_total: int = 0  # items received and not yet answered, over all calls
    max_unanswered_total: int = 0
    calls: int = 0
    unavailable: bool = False
    unavailable_after_output: bool = False
    generated: int = 0  # Generate and Stream calls answered
    reads_images: bool = True  # False: a turn with an image is refused, as a text model's engine refuses it
    images: list[bytes] = field(default_factory=list)  # every image of a chat turn received, in order
    reads_audio: bool = True  # False: a turn with an audio clip is refused, as a model that hears none refuses it
    audio: list[bytes] = field(default_factory=list)  # every audio clip of a chat turn received, in order
    transcribes: bool = True  # False: an Input.transcription is refused, as a text model's engine refuses it
    max_clip_s: float = MAX_CLIP_S  # the engine's --max-transcription-seconds: a longer clip is refused
    speech_only: bool = False  # True: every other input is refused, as a speech-to-text model's engine refuses it
    # Every transcription received (Generate and Stream), with the request's sampling, in order.
    heard: list[tuple[types_pb2.Transcription, types_pb2.SamplingParams]] = field(default_factory=list)
    _kills: set[asyncio.Event] = field(default_factory=set)  # one per Batch call running

    def kill_calls(self) -> None:
        """End every Batch call now running with UNAVAILABLE, as an engine that dies or drains does."""
        for kill in self._kills:
            kill.set()

    def _chat_refusal(self, value: types_pb2.Input) -> tuple[str, str] | None:
        """(message, param) of the engine's INVALID_ARGUMENT for a chat input's turns; None if they are fine (their
        images are then kept in `images`, their clips in `audio`)."""
        if value.WhichOneof("kind") != "chat":
            return None
        for i, message in enumerate(value.chat.messages):
            if message.content_parts and message.content:
                return "set a message's content or its content_parts, not both", f"messages[{i}].content"
            for j, part in enumerate(message.content_parts):
                kind = part.WhichOneof("part")
                if kind is None:
                    return "a content part must hold text, an image or audio", f"messages[{i}].content[{j}]"
                if kind == "image" and not self.reads_images:
                    return "this model reads text only; it takes no images", f"messages[{i}].content[{j}]"
                if kind == "audio" and not self.reads_audio:
                    return "this model hears no audio; it takes no audio clips", f"messages[{i}].content[{j}]"
        self.images += [p.image.data for m in value.chat.messages for p in m.content_parts if p.HasField("image")]
        self.audio += [p.audio.data for m in value.chat.messages for p in m.content_parts if p.HasField("audio")]
        return None

    def _speech_refusal(
        self, value: types_pb2.Input, sampling: types_pb2.SamplingParams | None = None
    ) -> tuple[str, str] | None:
        """(message, param) of the engine's INVALID_ARGUMENT for an input under the speech rules; None if it is
        fine (a transcription is then kept in `heard` by the caller)."""
        kind = value.WhichOneof("kind")
        if kind != "transcription":
            return ("this is a speech-to-text model; it takes an Input.transcription only", "input") \
                if self.speech_only else None
        if not self.transcribes:
            return "this model does not transcribe speech; it takes no Input.transcription", "input"
        speech = value.transcription
        if not speech.audio.data:
            return "a transcription needs its audio clip (Audio.data)", "transcription.audio"
        if speech.language and _language_code(speech.language) is None:
            return f"unknown language {speech.language!r}", "transcription.language"
        if speech.task not in types_pb2.TranscriptionTask.values():
            return f"unknown task {speech.task}", "transcription.task"
        if speech.temperature_fallback and sampling is not None and sampling.temperature:
            return ("temperature_fallback decodes greedily first, then hotter: the sampling's temperature must be 0, "
                    f"not {sampling.temperature}", "temperature")  # (the engine's words)
        if (seconds := clip_seconds(speech.audio.data)) > self.max_clip_s:
            return (f"the audio clip is {seconds:.1f} s long; this model hears at most {self.max_clip_s:.0f} s a clip: "
                    "send it in shorter clips", "transcription.audio")  # (the engine's words)
        return None

    async def Generate(self, request: engine_pb2.GenerateRequest, context: Any) -> engine_pb2.GenerateResponse:
        await asyncio.sleep(self.delay_s)
        if self.unavailable:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine went away")
        if (refused := self._speech_refusal(request.input, request.sampling)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused[0], (("ladle-param", refused[1]),))
        if request.input.HasField("transcription"):
            self.heard.append((request.input.transcription, request.sampling))
            self.generated += 1
            return _heard_reply(request.request_id, request.input.transcription, request.sampling)
        if (refused := self._chat_refusal(request.input)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused[0], (("ladle-param", refused[1]),))
        self.generated += 1
        return _result(request, _input_text(request.input))

    async def Stream(
        self, request: engine_pb2.StreamRequest, context: Any
    ) -> AsyncIterator[engine_pb2.StreamResponse]:
        if self.unavailable and not self.unavailable_after_output:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine went away")
        if (refused := self._speech_refusal(request.input, request.sampling)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused[0], (("ladle-param", refused[1]),))
        if request.input.HasField("transcription"):
            self.heard.append((request.input.transcription, request.sampling))
            for message in _heard_stream(request.request_id, request.input.transcription, request.sampling):
                yield message
                if self.unavailable:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine went away")
            self.generated += 1
            return
        if (refused := self._chat_refusal(request.input)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused[0], (("ladle-param", refused[1]),))
        text = _input_text(request.input).upper()
        half = len(text) // 2
        # As the engine: usage so far on every message (one "token" a message here), usage on the last.
        first = types_pb2.Usage(prompt_tokens=len(text), completion_tokens=1, total_tokens=len(text) + 1)
        yield engine_pb2.StreamResponse(request_id=request.request_id, choices=[
            types_pb2.ChoiceDelta(index=0, text=text[:half], token_ids=[1])], usage_so_far=first)
        if self.unavailable:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine went away")
        self.generated += 1
        last = types_pb2.Usage(prompt_tokens=len(text), completion_tokens=2, total_tokens=len(text) + 2)
        finish = types_pb2.FINISH_REASON_STOP
        yield engine_pb2.StreamResponse(request_id=request.request_id, choices=[
            types_pb2.ChoiceDelta(index=0, text=text[half:], token_ids=[2], finish_reason=finish)],
            usage=last, usage_so_far=last)

    async def Tokenize(self, request: engine_pb2.TokenizeRequest, context: Any) -> engine_pb2.TokenizeResponse:
        """Token ids 0..n-1 for the input's fake token count (`_tokens`), the last turn's echo as its prompt text;
        a chat input's turns under the engine's rules, as Generate keeps them."""
        if (refused := self._chat_refusal(request.input)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused[0], (("ladle-param", refused[1]),))
        return engine_pb2.TokenizeResponse(token_ids=range(_tokens(request.input)),
                                           prompt_text=_input_text(request.input))

    async def GetModelInfo(self, request: Any, context: Any) -> engine_pb2.GetModelInfoResponse:
        return engine_pb2.GetModelInfoResponse(
            model_id=MODEL, context_length=128, vocab_size=100, max_num_seqs=self.max_num_seqs,
            pooling=engine_pb2.PoolingInfo(method="last", normalize=True, dimensions=DIMENSIONS))

    async def Embed(self, request: engine_pb2.EmbedRequest, context: Any) -> engine_pb2.EmbedResponse:
        await asyncio.sleep(self.delay_s)
        if self.unavailable:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine went away")
        refused = _pooling_refusal(request, self.invalid)
        if refused is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused[0], (("ladle-param", refused[1]),))
        return _embed_result(request)

    async def Score(self, request: engine_pb2.ScoreRequest, context: Any) -> engine_pb2.ScoreResponse:
        await asyncio.sleep(self.delay_s)
        if self.unavailable:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine went away")
        refused = _pooling_refusal(request, self.invalid)
        if refused is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused[0], (("ladle-param", refused[1]),))
        return _score_result(request)

    async def GetLoad(self, request: Any, context: Any) -> engine_pb2.GetLoadResponse:
        return engine_pb2.GetLoadResponse(accepting=True)

    async def Batch(
        self, request_iterator: AsyncIterator[engine_pb2.BatchRequest], context: Any
    ) -> AsyncIterator[engine_pb2.BatchResponse]:
        self.calls += 1
        if self.unavailable:  # as a draining engine refuses a new Batch call, before reading any item
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine went away")
        die_after, self.die_after = self.die_after, None
        kill = asyncio.Event()
        self._kills.add(kill)
        if self.die_after_s is not None:
            asyncio.get_running_loop().call_later(self.die_after_s, kill.set)
        self.die_after_s = None
        results: asyncio.Queue[engine_pb2.BatchResponse | None] = asyncio.Queue()
        unanswered = 0
        slots = asyncio.Semaphore(2 * self.max_num_seqs)  # the engine's intake window (servicer._BatchRun)
        used: set[str] = set()
        broke: list[str] = []  # a break_call text this call received

        async def read() -> None:
            nonlocal unanswered
            async with asyncio.TaskGroup() as group:
                while True:
                    await slots.acquire()
                    item = await anext(request_iterator, None)
                    if item is None:
                        break
                    self.item_ids.append(item.item_id)
                    self.cache_salts[getattr(item, item.WhichOneof("pooling") or "request").cache_salt] += 1
                    if _text_of(item) in self.break_call:
                        broke.append(_text_of(item))
                        kill.set()
                    unanswered += 1
                    self.unanswered_total += 1
                    self.max_unanswered = max(self.max_unanswered, unanswered)
                    self.max_unanswered_total = max(self.max_unanswered_total, self.unanswered_total)
                    if not item.item_id or item.item_id in used:
                        await results.put(_refused_id(item))
                        continue
                    used.add(item.item_id)
                    group.create_task(self._answer(item, results))
            await results.put(None)

        reader = asyncio.create_task(read())
        sent = 0
        try:
            while True:
                response = await _first_of(results, kill)
                if kill.is_set():
                    if broke:
                        await context.abort(grpc.StatusCode.INTERNAL, f"the call broke on {broke[0]!r}")
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine went away")
                if response is None:
                    break
                if response.WhichOneof("outcome") == "result" and response.result.choices[0].text.lower() in \
                        self.oversize:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        "Received message larger than max (67109000 vs. 67108864)")
                if die_after is not None and sent >= die_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine went away")
                unanswered -= 1
                self.unanswered_total -= 1
                sent += 1
                if response.WhichOneof("outcome") == "result":
                    self.answered[response.result.choices[0].text.lower()] += 1
                yield response
                slots.release()
        finally:
            self.unanswered_total -= unanswered
            self._kills.discard(kill)
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader

    async def _answer(self, item: engine_pb2.BatchRequest, results: asyncio.Queue[Any]) -> None:
        kind = item.WhichOneof("pooling")
        text = _text_of(item)
        self.seen[text] += 1
        await asyncio.sleep(self.delay_s)
        response = engine_pb2.BatchResponse(item_id=item.item_id)
        if text in self.refuse_once and self.seen[text] == 1:
            response.error.code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            response.error.message = "queue full"
        elif (refused := _pooling_refusal(getattr(item, kind), self.invalid) if kind is not None
                else self._chat_refusal(item.request.input)) is not None:
            response.error.code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
            response.error.message, response.error.param = refused
        elif text in self.invalid:
            response.error.code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
            response.error.message = "max_tokens is too large"
            response.error.param = "max_tokens"
        elif kind == "embed":
            response.embed_result.CopyFrom(_embed_result(item.embed))
        elif kind == "score":
            response.score_result.CopyFrom(_score_result(item.score))
        else:
            response.result.CopyFrom(_result(item.request, text))
            if text in self.abort_once and self.seen[text] == 1:
                response.result.choices[0].finish_reason = types_pb2.FINISH_REASON_ABORT
        await results.put(response)


def _text_of(item: engine_pb2.BatchRequest) -> str:
    """The text an item is scripted by: its prompt's (last message's), an Embed call's first input's or a Score
    call's query's."""
    kind = item.WhichOneof("pooling")
    return _input_text(item.embed.inputs[0] if kind == "embed" else item.score.query if kind == "score"
                       else item.request.input)


def _refused_id(item: engine_pb2.BatchRequest) -> engine_pb2.BatchResponse:
    """The engine's answer to an item whose id is empty or was used before in the same call."""
    response = engine_pb2.BatchResponse(item_id=item.item_id)
    response.error.code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    response.error.param = "item_id"
    response.error.message = (f"item_id {item.item_id!r} was already used in this call" if item.item_id else
                              "item_id must not be empty: results are matched to items by it")
    return response


async def _first_of(results: asyncio.Queue[Any], kill: asyncio.Event) -> Any:
    """The next result, or None as soon as `kill` is set."""
    get = asyncio.ensure_future(results.get())
    killed = asyncio.ensure_future(kill.wait())
    await asyncio.wait({get, killed}, return_when=asyncio.FIRST_COMPLETED)
    killed.cancel()
    if not get.done():
        get.cancel()
        return None
    return get.result()


def _result(request: engine_pb2.GenerateRequest, text: str) -> engine_pb2.GenerateResponse:
    result = engine_pb2.GenerateResponse(request_id=request.request_id, model=MODEL)
    result.choices.add(index=0, text=text.upper(), finish_reason=types_pb2.FINISH_REASON_STOP)
    result.usage.prompt_tokens = len(text)
    result.usage.completion_tokens = 1
    return result


def _language_code(language: str) -> str | None:
    """A language's code in FAKE_LANGUAGES, given as a code or a name; None for one the fake does not know."""
    language = language.lower()
    if language in FAKE_LANGUAGES:
        return language
    return next((code for code, name in FAKE_LANGUAGES.items() if name == language), None)


def clip_seconds(data: bytes) -> float:
    """A clip's length as the fake reads it: a WAV file's frames over its rate; any other file as 16-bit mono 16
    kHz samples."""
    if data[:4] == b"RIFF":
        with contextlib.suppress(wave.Error, EOFError), wave.open(io.BytesIO(data)) as clip:
            return clip.getnframes() / clip.getframerate()
    return len(data) / 32_000


def heard_text(speech: types_pb2.Transcription) -> str:
    """The fake model's words for a clip: what it did and the clip's size, after the prompt's words if any (led by
    a space, as Whisper's text is)."""
    verb = "translated" if speech.task == types_pb2.TRANSCRIPTION_TASK_TRANSLATE else "heard"
    after = f" after {speech.prompt}" if speech.prompt else ""
    return f" {verb} {len(speech.audio.data)} bytes{after}"


def _heard_decode(speech: types_pb2.Transcription, sampling: types_pb2.SamplingParams
                  ) -> tuple[list[Piece], list[types_pb2.TranscriptionSegment]]:
    """The fake model's tokens for a clip, and its segments when it asks for timestamps: each word of `heard_text`
    (its leading space kept) with its id; with timestamps, each SEGMENT_WORDS words between their segment's start
    and end timestamp tokens, the segments' times spread evenly over the clip."""
    words = [" " + w for w in heard_text(speech).split()]
    if not speech.timestamps:
        return [_word(w, i, sampling) for i, w in enumerate(words)], []
    duration = clip_seconds(speech.audio.data)
    groups = [list(enumerate(words))[i:i + SEGMENT_WORDS] for i in range(0, len(words), SEGMENT_WORDS)]
    pieces: list[Piece] = []
    found = []
    for number, group in enumerate(groups):
        start, end = duration * number / len(groups), duration * (number + 1) / len(groups)
        tokens = [_timestamp(start, sampling), *(_word(w, i, sampling) for i, w in group), _timestamp(end, sampling)]
        found.append(types_pb2.TranscriptionSegment(
            start_seconds=start, end_seconds=end, text="".join(w for _, w in group),
            token_ids=[token for _, token, _ in tokens], first_token=len(pieces), seek=0,
            temperature=sampling.temperature, no_speech_prob=NO_SPEECH_PROB if speech.temperature_fallback else None))
        pieces += tokens
    return pieces, found


def _word(word: str, index: int, sampling: types_pb2.SamplingParams) -> Piece:
    """The token of the text's word `index`: id WORD_ID + index; its logprob -0.25 (index + 1) when asked."""
    token = WORD_ID + index
    return word, token, types_pb2.TokenLogprob(token_id=token, token=word, logprob=-0.25 * (index + 1),
                                               token_bytes=word.encode()) if sampling.logprobs else None


def _timestamp(seconds: float, sampling: types_pb2.SamplingParams) -> Piece:
    """The timestamp token of a time: no text (the engine keeps timestamps out of it); its logprob -0.125 when
    asked."""
    name = f"<|{seconds:.2f}|>"
    token = TIMESTAMP_ID + round(seconds / 0.02)
    return "", token, types_pb2.TokenLogprob(token_id=token, token=name, logprob=-0.125, token_bytes=name.encode()
                                             ) if sampling.logprobs else None


def _heard_info(speech: types_pb2.Transcription) -> types_pb2.TranscriptionInfo:
    return types_pb2.TranscriptionInfo(language=_language_code(speech.language) or "en",
                                       duration_seconds=clip_seconds(speech.audio.data))


def _heard_usage(speech: types_pb2.Transcription, completion: int) -> types_pb2.Usage:
    """Four prompt tokens (Whisper's start, language, task and no-timestamps tokens; three with timestamps) and one
    per prompt word."""
    prompt = (3 if speech.timestamps else 4) + len(speech.prompt.split())
    return types_pb2.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _heard_reply(request_id: str, speech: types_pb2.Transcription, sampling: types_pb2.SamplingParams
                 ) -> engine_pb2.GenerateResponse:
    pieces, found = _heard_decode(speech, sampling)
    result = engine_pb2.GenerateResponse(request_id=request_id, model=MODEL, transcription=_heard_info(speech),
                                         usage=_heard_usage(speech, len(pieces)))
    result.choices.add(index=0, text="".join(w for w, _, _ in pieces), token_ids=[t for _, t, _ in pieces],
                       logprobs=[lp for _, _, lp in pieces if lp is not None], segments=found,
                       words=_heard_words(speech), finish_reason=types_pb2.FINISH_REASON_STOP)
    return result


def _heard_words(speech: types_pb2.Transcription) -> list[types_pb2.TranscriptionWord]:
    """With `Transcription.word_timestamps`, each word of `heard_text` (its leading space kept) over an equal,
    consecutive share of the clip, as the engine's words come; else none."""
    if not speech.word_timestamps:
        return []
    words = [" " + w for w in heard_text(speech).split()]
    share = clip_seconds(speech.audio.data) / len(words)
    return [types_pb2.TranscriptionWord(word=w, start_seconds=i * share, end_seconds=(i + 1) * share)
            for i, w in enumerate(words)]


def _heard_stream(request_id: str, speech: types_pb2.Transcription, sampling: types_pb2.SamplingParams
                  ) -> list[engine_pb2.StreamResponse]:
    pieces, found = _heard_decode(speech, sampling)
    half = len(pieces) // 2
    messages = []
    for number, part in enumerate((pieces[:half], pieces[half:])):
        last = number == 1
        delta = types_pb2.ChoiceDelta(index=0, text="".join(w for w, _, _ in part), token_ids=[t for _, t, _ in part],
                                      logprobs=[lp for _, _, lp in part if lp is not None],
                                      finish_reason=types_pb2.FINISH_REASON_STOP if last else None,
                                      segments=found if last else None,
                                      words=_heard_words(speech) if last else None)
        so_far = _heard_usage(speech, half if not last else len(pieces))
        message = engine_pb2.StreamResponse(request_id=request_id, choices=[delta], usage_so_far=so_far)
        if last:
            message.usage.CopyFrom(so_far)
        else:
            message.transcription.CopyFrom(_heard_info(speech))
        messages.append(message)
    return messages


def _input_text(value: types_pb2.Input) -> str:
    if value.WhichOneof("kind") == "transcription":
        return heard_text(value.transcription)
    if value.WhichOneof("kind") == "chat":
        last = value.chat.messages[-1]
        return "".join(_part_text(p) for p in last.content_parts) or last.content
    return value.text


def _part_text(part: types_pb2.ContentPart) -> str:
    kind = part.WhichOneof("part")
    if kind == "image":
        return f"<image {len(part.image.data)}>"
    return f"<audio {len(part.audio.data)}>" if kind == "audio" else part.text


def _tokens(value: types_pb2.Input) -> int:
    """The fake engine's token count: one per character of text (of every message), per image, per audio clip or
    per id."""
    kind = value.WhichOneof("kind")
    if kind == "chat":
        return sum(len(m.content) + sum(len(p.text) if p.HasField("text") else 1 for p in m.content_parts)
                   for m in value.chat.messages)
    return len(value.token_ids.ids) if kind == "token_ids" else len(value.text)


def fake_vector(value: types_pb2.Input, dimensions: int | None = None, normalize: bool = True) -> list[float]:
    """The fake engine's embedding of an input: DIMENSIONS values in [-1, 1) from a hash of the input, its first
    `dimensions`, L2-normalized when `normalize`; as float32 values (what the proto carries)."""
    digest = hashlib.sha256(value.SerializeToString(deterministic=True)).digest()
    vector = [b / 128.0 - 1.0 for b in digest[:DIMENSIONS]][:dimensions]
    if normalize:
        norm = math.sqrt(sum(v * v for v in vector)) or 1.0
        vector = [v / norm for v in vector]
    return array.array("f", vector).tolist()


def fake_score(query: types_pb2.Input, document: types_pb2.Input) -> float:
    """The fake engine's score: the cosine similarity of the two fake vectors."""
    a, b = fake_vector(query), fake_vector(document)
    return sum(x * y for x, y in zip(a, b, strict=True))


def _pooling_refusal(request: engine_pb2.EmbedRequest | engine_pb2.ScoreRequest, invalid: set[str]
                     ) -> tuple[str, str] | None:
    """(message, param) of an INVALID_ARGUMENT for this request, as the engine would name it; None if it is fine."""
    if isinstance(request, engine_pb2.EmbedRequest):
        if request.HasField("dimensions") and not 1 <= request.dimensions <= DIMENSIONS:
            return f"dimensions must be in [1, {DIMENSIONS}]", "dimensions"
        if any(_input_text(i) in invalid for i in request.inputs):
            return "input is longer than the context length", "input"
        return None
    if _input_text(request.query) in invalid:
        return "query is longer than the context length", "query"
    if any(_input_text(d) in invalid for d in request.documents):
        return "documents is longer than the context length", "documents"
    return None


def _embed_result(request: engine_pb2.EmbedRequest) -> engine_pb2.EmbedResponse:
    dimensions = request.dimensions if request.HasField("dimensions") else None
    normalize = request.normalize if request.HasField("normalize") else True
    result = engine_pb2.EmbedResponse(request_id=request.request_id, model=MODEL)
    for index, value in enumerate(request.inputs):
        result.embeddings.add(index=index, values=fake_vector(value, dimensions, normalize), num_tokens=_tokens(value))
    result.usage.prompt_tokens = sum(_tokens(v) for v in request.inputs)
    return result


def _score_result(request: engine_pb2.ScoreRequest) -> engine_pb2.ScoreResponse:
    result = engine_pb2.ScoreResponse(request_id=request.request_id, model=MODEL,
                                      scores=[fake_score(request.query, d) for d in request.documents])
    result.usage.prompt_tokens = _tokens(request.query) + sum(_tokens(d) for d in request.documents)
    return result


async def start_fake_engine(fake: FakeEngine, max_message_bytes: int | None = None) -> tuple[grpc.aio.Server, str]:
    """Serve `fake` on a free loopback port; (server, address). `max_message_bytes`: the messages it takes and sends
    (the real engine's 64 MiB, say); None: grpc's defaults (4 MiB in)."""
    limits = [] if max_message_bytes is None else [("grpc.max_receive_message_length", max_message_bytes),
                                                    ("grpc.max_send_message_length", max_message_bytes)]
    server = grpc.aio.server(options=limits)
    engine_pb2_grpc.add_EngineServiceServicer_to_server(fake, server)
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("ladle.v1.EngineService", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def gateway_client(address: str, tmp_path: Path, **config: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client on an in-process gateway app (no batch workers) in front of the engine at `address`, once the
    gateway has the engine's model info; `config` adds GatewayConfig fields."""
    from gateway.app import create_app
    from gateway.config import GatewayConfig

    app = create_app(GatewayConfig(engines=(address,), data_dir=tmp_path, health_interval_s=0.05, batch_workers=0,
                                   **config))
    async with app.router.lifespan_context(app):
        pool = app.state.pool
        assert await pool.wait_ready(10)
        while pool.model_info() is None:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            yield client
