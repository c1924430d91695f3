"""Whisper's temperature fallback (`Transcription.temperature_fallback`, `multimodal.fallback`): Whisper's check of a
decode (its thresholds and arithmetic), the sampler's processed log-probabilities (transformers' `output_scores` after
its logits processors), the silence probe (transformers' `<|nospeech|>` probability after `<|startoftranscript|>`), and
on the tiny random Whisper of `test_whisper` the decodes the engine runs: greedy first, then hotter while the check
fails (the answer the decode at the temperature it stopped at, seeded, as decoding it alone gives), usage summed, a
silent window answered with no text, offline and over gRPC; what cannot fall back is refused by name."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_server.errors import ValidationError
from engine_server.frontend import fallback_answer
from engine_server.multimodal import fallback
from engine_server.multimodal.fallback import TEMPERATURES, DecodeCheck
from engine_server.multimodal.transcription import TranscriptionPrompt
from engine_server.sampling.metadata import SamplingMetadata, SamplingRow
from engine_server.sampling.sampler import Sampler
from engine_server.sampling_params import SamplingParams
from tests.unit.test_audio_input import heard
from tests.unit.test_whisper import (
    CASES,
    LONG_CUTS,
    engine_in,
    generate_and_stream,
    grpc_served,
    long_clip,
    reference_timestamps,
    save_whisper,
)

NEW = 12


def test_whispers_check_of_a_decode() -> None:
    """The mean log-probability counts the end token's and one more token than those before it; the compression ratio
    is zlib's over the stripped text; too repetitive or too unlikely fails unless the window is silence, which answers
    no text where its tokens are not above the threshold."""
    assert DecodeCheck.of(" hi", [-0.5, -1.0, -0.3], True, None).avg_logprob == pytest.approx(-1.8 / 3)
    assert DecodeCheck.of(" hi", [-0.5, -1.0, -0.3], False, None).avg_logprob == pytest.approx(-1.8 / 4)
    repeated = " the cat" * 40
    check = DecodeCheck.of(repeated, [-0.1] * 5, True, None)
    assert check.compression_ratio == len(repeated.strip().encode()) / len(zlib.compress(repeated.strip().encode()))
    assert check.compression_ratio > 2.4 and not check.passes and not check.silence
    assert DecodeCheck.of(" a cat", [-0.1] * 3, True, None).passes
    unlikely = DecodeCheck.of(" a cat", [-3.0] * 3, True, 0.5)
    assert not unlikely.passes and not unlikely.silence
    silent = DecodeCheck.of(" a cat", [-3.0] * 3, True, 0.7)
    assert silent.passes and silent.silence
    sure = DecodeCheck.of(" a cat", [-0.1] * 3, True, 0.9)
    assert sure.passes and not sure.silence


def test_processed_logprobs_are_the_logits_after_the_bans_before_the_temperature() -> None:
    """Rows with `processed_logprobs` get the log-softmax of their logits after logit_bias and the suppressed tokens
    (not of the temperature's quotient); the others the raw logits', in one batch."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=generator)
    processed = SamplingParams(temperature=0.7, seed=3, logprobs=True, processed_logprobs=True,
                               suppress_token_ids=(1, 2, 3), logit_bias={7: 2.0})  # fmt: skip
    rows = [SamplingRow(params, [1], [], frozenset({0}), 1, seed=3)
            for params in (processed, dataclasses.replace(processed, processed_logprobs=False), processed)]  # fmt: skip
    out = Sampler(50, "cpu").sample(logits, SamplingMetadata.build(rows, 50, torch.device("cpu")))
    assert out.logprobs is not None
    expected = logits.clone()
    expected[:, 7] += 2.0
    expected[:, 1:4] = float("-inf")
    tokens = out.token_ids
    for row, source in ((0, expected), (1, logits), (2, expected)):
        assert out.logprobs[row] == pytest.approx(float(source[row].log_softmax(-1)[tokens[row]]), abs=1e-6)


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("whisper")
    return folder, save_whisper(folder, timestamps=True)


def transformers_greedy(folder: Path, model: Any, prompt: TranscriptionPrompt) -> tuple[list[int], list[float], float]:
    """transformers' greedy tokens with timestamps (one decode), each token's log-probability under its processed
    scores (`output_scores`: after the suppressions and the timestamp processor), and `<|nospeech|>`'s probability
    after `<|startoftranscript|>` (the raw logits there, as Whisper reads silence)."""
    from transformers import AutoTokenizer, GenerationMixin, LogitsProcessorList, WhisperFeatureExtractor
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    ids, tokens = reference_timestamps(folder, model, prompt, NEW)
    features = WhisperFeatureExtractor.from_pretrained(folder)(heard(prompt.audio), sampling_rate=16_000,
                                                               return_tensors="pt").input_features  # fmt: skip
    rules = WhisperTimeStampLogitsProcessor(model.generation_config, len(ids))
    with torch.inference_mode():
        out = GenerationMixin.generate(model, input_features=features, decoder_input_ids=torch.tensor([ids]),
                                       logits_processor=LogitsProcessorList([rules]), max_new_tokens=NEW,
                                       do_sample=False, output_scores=True, return_dict_in_generate=True)  # fmt: skip
        logprobs = [float(score[0].log_softmax(-1)[token]) for score, token in zip(out.scores, tokens, strict=True)]
        start = ids.index(model.generation_config.decoder_start_token_id)
        logits = model(input_features=features, decoder_input_ids=torch.tensor([ids[: start + 1]])).logits[0, -1]
    no_speech = int(AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<|nospeech|>"))
    return tokens, logprobs, float(logits.float().softmax(-1)[no_speech])


@pytest.mark.slow
@pytest.mark.parametrize("thresholds", [None, (0.65, -10.0)])
def test_a_fallback_decodes_hotter_until_the_check_passes(
    whisper: tuple[Path, Any], thresholds: tuple[float, float] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two clips with timestamps and a seed under fallback (one with a previous text), beside a plain one: the first
    decode's tokens and processed log-probabilities are transformers' greedy ones, the silence probe's probability is
    transformers' at `<|startoftranscript|>`; each answer is the decode at the temperature where Whisper's check
    passed (else 1.0), as decoding it alone at that temperature with the seed gives, its segments carrying that
    temperature and the no-speech probability, usage the sum of the decodes, no log-probabilities (none asked); the
    plain clip is answered as alone. With Whisper's thresholds every decode of the random model is too unlikely (the
    last answers); with a compression ratio of 0.65 and no likelihood bound, one clip passes at once and the other
    at a middle temperature."""
    if thresholds is not None:
        monkeypatch.setattr(fallback, "COMPRESSION_RATIO_THRESHOLD", thresholds[0])
        monkeypatch.setattr(fallback, "LOGPROB_THRESHOLD", thresholds[1])
    stops: list[int] = []
    folder, model = whisper
    clips = [dataclasses.replace(CASES[case](), timestamps=True, temperature_fallback=True)
             for case in ("transcribe", "previous text")]  # fmt: skip
    plain = CASES["translate"]()
    params = SamplingParams(temperature=0.0, max_tokens=NEW, seed=7)
    with engine_in(folder) as llm:
        answers = llm.generate([*clips, plain], params, use_tqdm=False)
        runs: list[list[Any]] = []
        for prompt in clips:
            tried = []
            for temperature in TEMPERATURES:
                attempt, sampling = llm.inputs.fallback_attempt(prompt, params, temperature)
                tried.append((temperature, llm.generate([attempt], [sampling], use_tqdm=False)[0]))
            runs.append(tried)
        alone = llm.generate([plain], params, use_tqdm=False)[0]
    for prompt, answer, tried in zip(clips, answers[:2], runs, strict=True):
        tokens, logprobs, no_speech = transformers_greedy(folder, model, prompt)
        result = tried[0][1]
        assert result.choices[0].token_ids == tokens
        assert [t.logprob for t in result.choices[0].logprobs or ()] == pytest.approx(logprobs, abs=1e-4)
        checks = [DecodeCheck.of(r.choices[0].text, [t.logprob for t in r.choices[0].logprobs or ()],
                                 r.choices[0].finish_reason == "stop", no_speech) for _, r in tried]  # fmt: skip
        stop = next((n for n, check in enumerate(checks) if check.passes), len(TEMPERATURES) - 1)
        stops.append(stop)
        temperature, chosen = tried[stop]
        expected = [] if checks[stop].silence else chosen.choices[0].token_ids
        assert answer.choices[0].token_ids == expected and answer.choices[0].logprobs is None
        assert answer.usage.completion_tokens == sum(len(r.choices[0].token_ids) for _, r in tried[: stop + 1])
        assert answer.choices[0].segments and all(s.temperature == temperature for s in answer.choices[0].segments)
        assert all(s.no_speech_prob == pytest.approx(no_speech, abs=1e-5) for s in answer.choices[0].segments)
    assert answers[2].choices[0].token_ids == alone.choices[0].token_ids
    assert stops == [5, 5] if thresholds is None else (0 in stops and any(0 < stop < 5 for stop in stops))


@pytest.mark.slow
def test_a_long_clip_falls_back_window_by_window(whisper: tuple[Path, Any]) -> None:
    """The 65 s clip under fallback (timestamps, a seed): each of its three windows falls back on its own, as the
    window decoded alone under fallback answers; the joined usage sums theirs, the segments are theirs placed."""
    from engine_server.multimodal.clip_windows import window_wav

    folder, _ = whisper
    audio, samples = long_clip()
    prompt = TranscriptionPrompt(audio, "en", timestamps=True, temperature_fallback=True)
    windows = [dataclasses.replace(prompt, audio=window_wav(samples[a:b], 16_000))
               for a, b in itertools.pairwise(LONG_CUTS)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=6, seed=11)
    with engine_in(folder) as llm:
        (joined,) = llm.generate([prompt], params, use_tqdm=False)
        alone = llm.generate(windows, params, use_tqdm=False)
    assert joined.choices[0].token_ids == [t for r in alone for t in r.choices[0].token_ids]
    assert joined.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone) > 3 * 6  # (hotter too)
    assert [(s.temperature, s.no_speech_prob) for s in joined.choices[0].segments] == [
        (s.temperature, s.no_speech_prob) for r in alone for s in r.choices[0].segments]
    assert {s.seek for s in joined.choices[0].segments} == {0, 2945, 5880}


@pytest.mark.slow
def test_a_silent_window_answers_no_text_and_is_not_decoded_again(
    whisper: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the silence threshold at 0 (so the random model's clip reads as silence), its tokens unlikely: one decode,
    answered with no text, tokens or segments; log-probabilities asked come back empty."""
    monkeypatch.setattr(fallback, "NO_SPEECH_THRESHOLD", 0.0)
    folder, _ = whisper
    prompt = dataclasses.replace(CASES["transcribe"](), timestamps=True, temperature_fallback=True)
    with engine_in(folder) as llm:
        (answer,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=True),
                                 use_tqdm=False)  # fmt: skip
    choice = answer.choices[0]
    assert (choice.text, choice.token_ids, choice.segments, choice.logprobs) == ("", [], [], [])
    assert 0 < answer.usage.completion_tokens <= NEW  # (one decode)


@pytest.mark.slow
@pytest.mark.parametrize(("params", "param"), [
    (SamplingParams(temperature=0.5, max_tokens=NEW), "temperature"),
    (SamplingParams(temperature=0.0, n=2, max_tokens=NEW), "n"),
])  # fmt: skip
def test_what_cannot_fall_back_is_refused_by_name(
    whisper: tuple[Path, Any], params: SamplingParams, param: str
) -> None:
    prompt = dataclasses.replace(CASES["transcribe"](), temperature_fallback=True)
    with engine_in(whisper[0]) as llm, pytest.raises(ValidationError, match="temperature_fallback") as refused:
        llm.generate([prompt], params, use_tqdm=False)
    assert refused.value.param == param


@pytest.mark.slow
def test_a_fallback_over_grpc(whisper: tuple[Path, Any]) -> None:
    """`Transcription.temperature_fallback` over the servicer's Generate and Stream: the answer the offline engine
    gives (a seed), its segments' temperature and no-speech probability on the wire; Stream sends it as one delta."""
    from engine_server.server.convert import prompt_from_input
    from ladle.v1 import types_pb2

    folder, _ = whisper
    prompt = dataclasses.replace(CASES["transcribe"](), timestamps=True, temperature_fallback=True)
    message = types_pb2.Input(transcription=types_pb2.Transcription(
        audio=types_pb2.Audio(data=prompt.audio), language="en", timestamps=True, temperature_fallback=True))
    assert prompt_from_input(message) == prompt
    params = SamplingParams(temperature=0.0, max_tokens=NEW, seed=7)
    with engine_in(folder) as llm:
        (offline,) = llm.generate([prompt], params, use_tqdm=False)
    sampling = types_pb2.SamplingParams(temperature=0.0, max_tokens=NEW, seed=7)

    whole, stream = generate_and_stream(folder, message, sampling)
    assert list(whole.choices[0].token_ids) == offline.choices[0].token_ids
    assert whole.usage.completion_tokens == offline.usage.completion_tokens
    wire = [(round(s.temperature, 3), round(s.no_speech_prob, 5)) for s in whole.choices[0].segments]
    assert wire and wire == [(s.temperature, round(s.no_speech_prob or 0.0, 5)) for s in offline.choices[0].segments]
    deltas = [choice for m in stream for choice in m.choices]
    assert len(deltas) == 1 and list(deltas[0].token_ids) == offline.choices[0].token_ids
    assert math.isclose(deltas[0].segments[0].temperature, whole.choices[0].segments[0].temperature)


@pytest.mark.slow
def test_a_waiting_caller_waits_for_every_request_a_transcription_makes(whisper: tuple[Path, Any]) -> None:
    """A caller that waits for room in a full queue (`generate(wait=True)`: the Batch RPC) has its language detection,
    its silence probe and every decode of its fallback wait too (none raises QueueFullError)."""
    from engine_server.frontend import LanguageDetection, SilenceProbe
    from engine_server.server.serving import GenerationInput

    folder, _ = whisper
    prompt = dataclasses.replace(CASES["transcribe"](), language="", temperature_fallback=True)
    seen: list[tuple[str, bool]] = []

    async def run() -> None:
        async with grpc_served(folder) as (_, engine):
            generate = engine.generate

            def spy(request: GenerationInput, deadline: Any = None, whole: bool = False, wait: bool = False) -> Any:
                seen.append((type(request.prompt).__name__, wait))
                return generate(request, deadline, whole, wait)

            engine.generate = spy
            params = SamplingParams(temperature=0.0, max_tokens=4)
            async for _ in engine.generate(GenerationInput("w", prompt, params), wait=True):
                pass

    asyncio.run(run())
    kinds = {kind for kind, _ in seen}
    assert {LanguageDetection.__name__, SilenceProbe.__name__, TranscriptionPrompt.__name__} <= kinds
    assert all(wait for _, wait in seen) and len(seen) >= 4


def test_a_fallback_answer_joins_its_decodes() -> None:
    """`fallback_answer` (pure): the last decode's choice, usage summed, segments given the temperature and the
    no-speech probability, logprobs dropped where not asked; silence: nothing."""
    from engine_server.frontend import Choice, GenerationResult, TokenLogprob, Usage
    from engine_server.multimodal.transcription import TranscriptionSegment

    segment = TranscriptionSegment(0.0, 1.0, " a", (9, 3, 10), 0, 0)
    lp = TokenLogprob(3, "a", -0.5, b"a")
    decodes = [GenerationResult("r", [1], [Choice(0, " b", [4, 5], "stop", 0, [lp, lp])], Usage(4, 2, 1)),
               GenerationResult("r", [1], [Choice(0, " a", [9, 3, 10, 0], "stop", 0, [lp] * 4, segments=[segment])],
                                Usage(4, 4, 4))]  # fmt: skip
    check = DecodeCheck(-0.5, 1.0, 0.25)
    answer = fallback_answer(decodes, check, 0.2, keep_logprobs=False)
    assert answer.choices[0].token_ids == [9, 3, 10, 0] and answer.choices[0].logprobs is None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.cached_prompt_tokens) == (8, 6, 5)
    assert answer.choices[0].segments == [dataclasses.replace(segment, temperature=0.2, no_speech_prob=0.25)]
    silent = fallback_answer(decodes, DecodeCheck(-2.0, 1.0, 0.9), 0.0, keep_logprobs=True)
    assert (silent.choices[0].text, silent.choices[0].token_ids, silent.choices[0].logprobs) == ("", [], [])
