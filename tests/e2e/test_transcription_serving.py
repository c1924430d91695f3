"""Speech to text end to end: a tiny random Whisper checkpoint as transformers saves it, with Whisper's timestamp tokens
(tests/unit/test_whisper.py) behind `ladle engine --quantization none` and `ladle gateway`, through the official openai
SDK's `audio.transcriptions` and `audio.translations` and through the engine's own gRPC API. Every answer is
transformers' greedy decode for the clip as the engine hears it (`reference_timestamps`: one decode, under its
timestamp processor where the answer shows times): a given language, a detected one (verbose_json names it, with the
segments transformers' tokenizer reads), a translation, a stream whose deltas add up to the text, srt cues. A chat
sent to the Whisper engine, and a transcription sent to a text model's engine, are 400s naming what each serves."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from engine_server.multimodal.transcription import TranscriptionPrompt
from ladle.client import EngineClient
from ladle.v1 import engine_pb2, types_pb2
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, start_gateway
from tests.unit.test_audio_input import clip
from tests.unit.test_whisper import reference, reference_timestamps, save_whisper

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def whisper_served(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, Any, EngineProcess, GatewayProcess]]:
    """A tiny Whisper checkpoint behind `ladle engine` and the gateway."""
    root = tmp_path_factory.mktemp("whisper")
    folder = root / "model"
    model = save_whisper(folder, timestamps=True)
    path = folder / "generation_config.json"  # (alignment heads: word timings)
    path.write_text(json.dumps({**json.loads(path.read_text()), "alignment_heads": [[1, 0], [1, 2], [0, 3]]}))
    engine = start_engine(root / "engine.log", "--model", str(folder), "--quantization", "none", threads=1)
    gateway = start_gateway(root / "gateway.log", engine.address)
    yield folder, model, engine, gateway
    assert gateway.stop() == 0
    assert engine.stop() == 0


def expected_text(folder: Path, tokens: list[int]) -> str:
    """transformers' text of `tokens`, trimmed as OpenAI's answers are."""
    from transformers import AutoTokenizer

    return str(AutoTokenizer.from_pretrained(folder).decode(tokens, skip_special_tokens=True)).strip()


def decoded(folder: Path, model: Any, prompt: TranscriptionPrompt) -> tuple[list[int], list[int]]:
    """transformers' prompt ids and tokens of one greedy decode of `prompt` (its language detected as
    `detect_language` does where it names none)."""
    if not prompt.language:
        ids = reference(folder, model, prompt, 1)[0]
        codes = {token: key[2:-2] for key, token in model.generation_config.lang_to_id.items()}
        prompt = dataclasses.replace(prompt, language=codes[ids[-3]])
    return reference_timestamps(folder, model, prompt, NEW_TOKENS)


def no_speech(folder: Path, model: Any, data: bytes) -> float:
    """transformers' probability of `<|nospeech|>` right after `<|startoftranscript|>` for the clip (Whisper's
    measure of silence)."""
    import torch
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    from tests.unit.test_audio_input import heard

    features = WhisperFeatureExtractor.from_pretrained(folder)(heard(data), sampling_rate=16_000,
                                                               return_tensors="pt").input_features  # fmt: skip
    start = torch.tensor([[model.generation_config.decoder_start_token_id]])
    with torch.inference_mode():
        logits = model(input_features=features, decoder_input_ids=start).logits[0, -1]
    return float(logits.softmax(-1)[AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<|nospeech|>")])


def offsets(folder: Path, tokens: list[int], seconds: float) -> list[tuple[str, float, float]]:
    """transformers' segments of `tokens` (its tokenizer's `output_offsets`), times held to the clip's `seconds`."""
    from transformers import AutoTokenizer

    found = AutoTokenizer.from_pretrained(folder).decode(tokens, output_offsets=True)["offsets"]
    return [(o["text"], min(o["timestamp"][0], seconds), min(o["timestamp"][1], seconds)) for o in found]


def test_the_openai_sdk_transcribes_and_translates_as_transformers_does(
    whisper_served: tuple[Path, Any, EngineProcess, GatewayProcess],
) -> None:
    """A WAV in English (json), a 22.05 kHz clip whose language is detected (verbose_json: its name, its length and the
    segments of a decode with timestamps; srt: a cue each), a German FLAC translated, and the first one streamed: each
    text is transformers' greedy tokens' for the clip as the engine hears it (ladle's `temperature_fallback` false);
    the first under Whisper's temperature fallback (OpenAI's default) decodes hotter, its silence measured as
    transformers measures it."""
    folder, model, _, gateway = whisper_served
    sdk = openai.OpenAI(base_url=gateway.base_url, api_key="unused")
    model_id = sdk.models.list().data[0].id
    limit = {"max_completion_tokens": NEW_TOKENS, "temperature_fallback": False}  # (one greedy decode each)
    english, unknown, german = clip(11, 1.5), clip(12, 2.0, 22_050), clip(13, 1.2, 44_100, 2, "FLAC")

    reply = sdk.audio.transcriptions.create(model=model_id, file=("a.wav", english), language="en", extra_body=limit)
    _, tokens = decoded(folder, model, TranscriptionPrompt(english, "en"))
    assert reply.text == expected_text(folder, tokens)

    verbose = sdk.audio.transcriptions.create(model=model_id, file=("b.wav", unknown), response_format="verbose_json",
                                              extra_body=limit)  # fmt: skip
    ids, tokens = decoded(folder, model, TranscriptionPrompt(unknown, timestamps=True))
    codes = {v: k[2:-2] for k, v in model.generation_config.lang_to_id.items()}
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    assert verbose.language == LANGUAGES[codes[ids[1]]]  # (the language token transformers' detection picks)
    assert verbose.text == expected_text(folder, tokens)
    assert verbose.duration == pytest.approx(2.0, abs=1e-3)
    closed = offsets(folder, tokens, 2.0)
    assert verbose.segments is not None and len(verbose.segments) >= len(closed) > 0
    assert [(s.text, s.start, s.end) for s in verbose.segments[:len(closed)]] == [
        (text, pytest.approx(start, abs=1e-6), pytest.approx(end, abs=1e-6)) for text, start, end in closed]
    assert [t for s in verbose.segments for t in s.tokens] == tokens[:sum(len(s.tokens) for s in verbose.segments)]
    subtitles = sdk.audio.transcriptions.create(model=model_id, file=("b.wav", unknown), response_format="srt",
                                                extra_body=limit)  # fmt: skip
    assert str(subtitles).count(" --> ") == len(verbose.segments)
    fell_back = sdk.audio.transcriptions.create(model=model_id, file=("a.wav", english), language="en",
                                                response_format="verbose_json",
                                                extra_body={"max_completion_tokens": NEW_TOKENS, "seed": 5})
    assert fell_back.segments  # (Whisper's temperature fallback: the random model's decodes all read as too unlikely)
    assert {s.temperature for s in fell_back.segments} <= {0.2, 0.4, 0.6, 0.8, 1.0}
    silence = no_speech(folder, model, english)
    assert all(s.no_speech_prob == pytest.approx(silence, rel=1e-3) for s in fell_back.segments)

    translated = sdk.audio.translations.create(model=model_id, file=("c.flac", german), extra_body={
        **limit, "language": "de"})  # fmt: skip
    _, tokens = decoded(folder, model, TranscriptionPrompt(german, "de", "translate"))
    assert translated.text == expected_text(folder, tokens)

    stream = sdk.audio.transcriptions.create(model=model_id, file=("a.wav", english), language="en", stream=True,
                                             extra_body=limit)  # fmt: skip
    events = list(stream)
    deltas = "".join(event.delta for event in events if event.type == "transcript.text.delta")
    done = [event for event in events if event.type == "transcript.text.done"]
    assert len(done) == 1 and done[0].text == reply.text and deltas.strip() == reply.text


def test_a_long_clip_through_the_sdk_answers_its_windows_segments(
    whisper_served: tuple[Path, Any, EngineProcess, GatewayProcess],
) -> None:
    """A 65 s clip (a 4 MB float WAV) as verbose_json and srt through the SDK: the engine cuts it into three windows
    at its quiet gaps, and the answer is each window's transformers decode with timestamps, their segments placed in
    the clip (starts moved by 29.45 s and 58.8 s, `seek` the window's), the duration the whole clip's."""
    from engine_server.multimodal.clip_windows import window_wav
    from tests.unit.test_whisper import LONG_CUTS, long_clip

    folder, model, _, gateway = whisper_served
    sdk = openai.OpenAI(base_url=gateway.base_url, api_key="unused")
    model_id = sdk.models.list().data[0].id
    audio, samples = long_clip()
    limit = {"max_completion_tokens": NEW_TOKENS, "temperature_fallback": False}
    verbose = sdk.audio.transcriptions.create(model=model_id, file=("long.wav", audio), language="en",
                                              response_format="verbose_json", extra_body=limit)  # fmt: skip
    expected: list[tuple[str, float, float, int]] = []
    for (start, end), offset in zip(itertools.pairwise(LONG_CUTS), (0.0, 29.45, 58.8), strict=False):
        window = TranscriptionPrompt(window_wav(samples[start:end], 16_000), "en", timestamps=True)
        tokens = reference_timestamps(folder, model, window, NEW_TOKENS)[1]
        expected += [(text, round(begin + offset, 3), round(stop + offset, 3), round(offset * 100))
                     for text, begin, stop in offsets(folder, tokens, (end - start) / 16_000)]  # fmt: skip
    assert verbose.duration == pytest.approx(65.0, abs=1e-3) and verbose.segments is not None
    got = [(s.text, round(s.start, 3), round(s.end, 3), s.seek) for s in verbose.segments]
    answered = iter(got)  # transformers' closed segments, in order, among ours (ours keep an unclosed last one too)
    assert expected and all(segment in answered for segment in expected)
    assert {s.seek for s in verbose.segments} == {0, 2945, 5880}
    subtitles = str(sdk.audio.transcriptions.create(model=model_id, file=("long.wav", audio), language="en",
                                                    response_format="srt", extra_body=limit))  # fmt: skip
    assert subtitles.count(" --> ") == len(verbose.segments)


def test_word_timings_through_the_sdk_are_the_engines(
    whisper_served: tuple[Path, Any, EngineProcess, GatewayProcess],
) -> None:
    """verbose_json with `timestamp_granularities=["word", "segment"]` through the SDK answers the words the engine
    gives a gRPC caller for the same clip (trimmed; their times as the engine's), and its segments."""
    _, _, engine, gateway = whisper_served
    sdk = openai.OpenAI(base_url=gateway.base_url, api_key="unused")
    model_id = sdk.models.list().data[0].id
    data = clip(16, 2.5)
    verbose = sdk.audio.transcriptions.create(
        model=model_id, file=("w.wav", data), language="en", response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
        extra_body={"max_completion_tokens": NEW_TOKENS, "temperature_fallback": False})  # fmt: skip
    speech = types_pb2.Transcription(audio=types_pb2.Audio(data=data), language="en", timestamps=True,
                                     word_timestamps=True)  # fmt: skip
    with EngineClient(engine.address) as client:
        reply = client.generate(engine_pb2.GenerateRequest(input=types_pb2.Input(transcription=speech),
                                sampling=types_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)))
    words = [(w.word.strip(), w.start_seconds, w.end_seconds) for w in reply.choices[0].words]
    assert words and verbose.words is not None and verbose.segments
    assert [(w.word, w.start, w.end) for w in verbose.words] == words


def test_grpc_callers_send_transcriptions(whisper_served: tuple[Path, Any, EngineProcess, GatewayProcess]) -> None:
    """`Input.transcription` over gRPC: transformers' prompt ids and tokens, the clip's language and length on the
    reply; a chat turn to the Whisper engine is INVALID_ARGUMENT naming what it serves."""
    folder, model, engine, _ = whisper_served
    data = clip(14, 1.0, 8_000)
    ids, tokens = decoded(folder, model, TranscriptionPrompt(data, "fr", prompt="the cat"))
    speech = types_pb2.Transcription(audio=types_pb2.Audio(data=data), language="french", prompt="the cat",
                                     task=types_pb2.TRANSCRIPTION_TASK_TRANSCRIBE)  # fmt: skip
    with EngineClient(engine.address) as client:
        reply = client.generate(engine_pb2.GenerateRequest(
            input=types_pb2.Input(transcription=speech),
            sampling=types_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, return_prompt_token_ids=True),
        ))  # fmt: skip
        assert list(reply.prompt_token_ids) == ids
        assert list(reply.choices[0].token_ids) == tokens
        assert reply.transcription.language == "fr"
        assert reply.transcription.duration_seconds == pytest.approx(1.0, abs=1e-3)
        chat = types_pb2.ChatInput(messages=[types_pb2.ChatMessage(role="user", content="hello")])
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(engine_pb2.GenerateRequest(input=types_pb2.Input(chat=chat)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Input.transcription" in str(refused.value.details())


def test_a_chat_to_whisper_and_a_transcription_to_a_text_model_are_refused(
    whisper_served: tuple[Path, Any, EngineProcess, GatewayProcess], openai_client: openai.OpenAI, model_id: str,
) -> None:
    """Through the gateway: a chat completion on the Whisper engine, and a transcription on the default text model's
    engine, are 400s whose messages say what each model serves."""
    _, _, _, gateway = whisper_served
    sdk = openai.OpenAI(base_url=gateway.base_url, api_key="unused")
    whisper_id = sdk.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="transcription") as chat:
        sdk.chat.completions.create(model=whisper_id, messages=[{"role": "user", "content": "hello"}], max_tokens=2)
    assert chat.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="does not transcribe") as speech:
        openai_client.audio.transcriptions.create(model=model_id, file=("a.wav", clip(15, 0.5)))
    assert speech.value.status_code == 400
