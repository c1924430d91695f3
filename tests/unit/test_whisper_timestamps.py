"""Whisper's timestamps (`Transcription.timestamps`): the sampler holds a decode to transformers'
`WhisperTimeStampLogitsProcessor` rules (its masked logits equal the processor's, row by row in a mixed batch), a
decode's tokens read as the segments transformers' tokenizer reads from them (`output_offsets`), and on the tiny random
Whisper of `test_whisper` the engine's greedy tokens with timestamps are transformers' under that processor, short
clips and a long clip's windows (their segments placed in the clip), offline and over gRPC. Timestamp tokens never
reach a text, with or without timestamps, as transformers' `decode` filters them."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_server.errors import ValidationError
from engine_server.multimodal.transcription import TIME_PRECISION, TimestampTokens, TranscriptionPrompt
from engine_server.sampling.metadata import SamplingRow
from engine_server.sampling.sampler import Sampler
from engine_server.sampling_params import SamplingParams, TimestampRules
from tests.unit.test_whisper import (
    CASES,
    GREEDY,
    LONG_CUTS,
    NEW_TOKENS,
    engine_in,
    generate_and_stream,
    long_clip,
    reference_timestamps,
    save_whisper,
    whisper_tokenizer,
)

# A small vocabulary laid out as Whisper's: text, eos at 80, specials, <|notimestamps|> at 89, timestamps from 90.
VOCAB, EOS, NO_TIMESTAMPS, BEGIN = 130, 80, 89, 90
RULES = TimestampRules(BEGIN, EOS, NO_TIMESTAMPS, max_initial=5)


def timestamp(seconds: float) -> int:
    return BEGIN + round(seconds / TIME_PRECISION)


SEQUENCES = [
    [],
    [timestamp(0.1)],
    [timestamp(0.1), 3],
    [timestamp(0.1), 3, 4, timestamp(0.5)],
    [timestamp(0.1), 3, timestamp(0.5), timestamp(0.5)],
    [timestamp(0.1), 3, timestamp(0.5), timestamp(0.7), 9],
    [timestamp(0.1), 3, timestamp(0.5), timestamp(0.7), 9, 10, 11],
    [3, 4],  # (no timestamp yet: not under the rules, but the processor reads any sequence)
    [timestamp(0.3), 3, timestamp(0.2)],
]


def transformers_rules(prompt: list[int], outputs: list[int], logits: torch.Tensor) -> torch.Tensor:
    from transformers import GenerationConfig
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    config = GenerationConfig(no_timestamps_token_id=NO_TIMESTAMPS, eos_token_id=EOS, max_initial_timestamp_index=5)
    processor = WhisperTimeStampLogitsProcessor(config, begin_index=len(prompt))
    return processor(torch.tensor([[*prompt, *outputs]]), logits.unsqueeze(0).clone())[0]


def test_the_sampler_holds_rows_to_transformers_timestamp_rules() -> None:
    """Every sequence twice (its timestamps' logits raised in one, so the rule that samples a timestamp where they
    together outweigh the likeliest other token fires), batched with a row that has no rules between them: each
    timestamp row's logits as the sampler leaves them are the processor's, and the plain row's are untouched."""
    generator = torch.Generator().manual_seed(0)
    prompt = [1, 2, 3]
    rows, logits, expected = [], [], []
    for outputs, raise_by in itertools.product(SEQUENCES, (0.0, 4.5)):
        row_logits = torch.randn(VOCAB, generator=generator)
        row_logits[BEGIN:] += raise_by
        params = SamplingParams(temperature=0.0, timestamps=RULES)
        rows.append(SamplingRow(params, prompt, outputs, frozenset({EOS}), len(prompt) + len(outputs)))
        logits.append(row_logits)
        expected.append(transformers_rules(prompt, outputs, row_logits))
        plain = torch.randn(VOCAB, generator=generator)
        rows.append(SamplingRow(SamplingParams(temperature=0.0), prompt, outputs, frozenset({EOS}), 3))
        logits.append(plain)
        expected.append(plain)
    processed = Sampler(VOCAB, "cpu").process_logits(torch.stack(logits), rows)
    for ours, theirs in zip(processed, expected, strict=True):
        assert torch.equal(ours.isinf(), theirs.isinf())
        assert torch.equal(ours[~ours.isinf()], theirs[~theirs.isinf()])
    forced = [bool(row[:BEGIN].isinf().all()) for row in processed[::2]]
    assert any(forced) and not all(forced)  # (the likelihood rule fires on some rows, not all)


def test_a_decodes_tokens_read_as_transformers_reads_its_segments(tmp_path: Path) -> None:
    """Closed segments (a pair of timestamps after one, timestamps apart in time) read as the tokenizer's
    `output_offsets`; an unclosed one ends at the window's end (transformers drops it); the eos is in none; each
    segment's tokens sit at `first_token` in the choice's; a window's offset moves times and seek; times stop at the
    window's end; an opening timestamp with no text is no segment."""
    tokenizer = whisper_tokenizer(tmp_path, timestamps=True)
    begin = tokenizer.convert_tokens_to_ids("<|0.00|>")
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    words = tokenizer.encode(" the cat at the hat", add_special_tokens=False)
    ids = [begin + 10, *words[:2], begin + 60, begin + 60, *words[2:], begin + 125, eos]
    theirs = tokenizer.decode(ids, output_offsets=True)["offsets"]

    def decode(tokens: list[int]) -> str:
        return str(tokenizer.decode(tokens, skip_special_tokens=True))

    read = TimestampTokens(begin, True, 0.0, 30.0).read(ids, eos, decode)
    assert [(s.text, (s.start, s.end)) for s in read] == [(o["text"], o["timestamp"]) for o in theirs]
    assert [s.token_ids for s in read] == [tuple(ids[0:4]), tuple(ids[4:-1])]
    assert all(ids[s.first_token:s.first_token + len(s.token_ids)] == list(s.token_ids) for s in read)
    unclosed = [*ids[:4], begin + 60, *words[2:]]
    read = TimestampTokens(begin, True, 0.0, 30.0).read(unclosed, None, decode)
    assert [(s.start, s.end) for s in read] == [(0.2, 1.2), (1.2, 30.0)] and read[1].text == decode(words[2:])
    shifted = TimestampTokens(begin, True, 29.45, 2.0).read(ids, eos, decode)
    assert [(s.start, s.end, s.seek) for s in shifted] == [(29.65, 30.65, 2945), (30.65, 31.45, 2945)]
    assert TimestampTokens(begin, True, 0.0, 30.0).read([begin, eos], eos, decode) == []


def test_timestamp_tokens_split_a_texts_decode_as_transformers_decode_does(tmp_path: Path) -> None:
    """A character's bytes on either side of a timestamp token: the detokenizer gives transformers' `decode` of the
    whole (each side decoded apart, its broken bytes as U+FFFD, the timestamp left out), whole and token by token; a
    request decoding with timestamps needs its outputs on the host before each step (no step runs ahead)."""
    from engine_server.core.request import Request
    from engine_server.output.detokenizer import IncrementalDetokenizer

    tokenizer = whisper_tokenizer(tmp_path, timestamps=True)
    begin = tokenizer.convert_tokens_to_ids("<|0.00|>")
    first, second = tokenizer.encode(" é", add_special_tokens=False)[-2:]  # (its two bytes, one token each)
    ids = [*tokenizer.encode(" the", add_special_tokens=False), first, begin + 7, second, begin + 9, first, second]
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert "\ufffd" in expected and expected.endswith("é")
    whole = IncrementalDetokenizer(tokenizer, [], silent_from=begin)
    assert whole.add(ids) + whole.flush() == expected
    each = IncrementalDetokenizer(tokenizer, [], silent_from=begin)
    assert "".join(each.add([token]) for token in ids) + each.flush() == expected
    params = SamplingParams(temperature=0.0, timestamps=RULES)
    assert Request("r", [1, 2], params, max_model_len=64).needs_output_history


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("whisper")
    return folder, save_whisper(folder, timestamps=True)


def segments_of(folder: Path, tokens: list[int], seconds: float) -> list[tuple[str, float, float]]:
    """transformers' segments of a decode (its tokenizer's `output_offsets`), times held to the clip's `seconds`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    offsets = tokenizer.decode(tokens, output_offsets=True)["offsets"]
    return [(o["text"], min(o["timestamp"][0], seconds), min(o["timestamp"][1], seconds)) for o in offsets]


def text_of(folder: Path, tokens: list[int]) -> str:
    from transformers import AutoTokenizer

    return str(AutoTokenizer.from_pretrained(folder).decode(tokens, skip_special_tokens=True))


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [2048, 3])
def test_timestamped_transcriptions_equal_transformers(chunk: int, whisper: tuple[Path, Any]) -> None:
    """Transcribe, translate and a previous text with timestamps, batched with the same clips without, whole and in
    prefill chunks of 3: the prompts leave `<|notimestamps|>` out, the tokens are transformers' one decode under its
    timestamp processor (the plain ones' without it: `reference_timestamps`), every closed segment is what its
    tokenizer reads (times held to the clip), the segments sit in the choice's tokens in order, and no text holds a
    timestamp token (each choice's text is transformers' `decode` of its tokens)."""
    folder, model = whisper
    clips = [CASES[case]() for case in ("transcribe", "translate", "previous text")]
    timed = [dataclasses.replace(prompt, timestamps=True) for prompt in clips]
    expected = [reference_timestamps(folder, model, prompt, 30) for prompt in timed]
    plain = [reference_timestamps(folder, model, prompt, 30) for prompt in clips]
    with engine_in(folder, chunk=chunk) as llm:
        results = llm.generate([*timed, *clips], dataclasses.replace(GREEDY, max_tokens=30), use_tqdm=False)
    assert [r.prompt_token_ids for r in results] == [ids for ids, _ in expected] + [ids for ids, _ in plain]
    assert [r.choices[0].token_ids for r in results] == [t for _, t in expected] + [t for _, t in plain]
    assert any(t >= timestamp_begin(folder) for _, tokens in plain for t in tokens)  # (the plain decodes' too)
    for result in results[:3]:
        choice, info = result.choices[0], result.transcription
        assert info is not None and choice.segments
        closed = segments_of(folder, choice.token_ids, info.duration_seconds)
        assert [(s.text, s.start, s.end) for s in choice.segments[:len(closed)]] == closed
        ends = [s.first_token + len(s.token_ids) for s in choice.segments]
        assert all(end <= after.first_token for end, after in zip(ends, choice.segments[1:], strict=False))
        assert all(choice.token_ids[s.first_token:s.first_token + len(s.token_ids)] == list(s.token_ids)
                   for s in choice.segments)  # fmt: skip
        assert all(0.0 <= s.start <= s.end <= info.duration_seconds and s.seek == 0 for s in choice.segments)
    for result in results:
        assert result.choices[0].text == text_of(folder, result.choices[0].token_ids)
    assert all(not r.choices[0].segments for r in results[3:])


def timestamp_begin(folder: Path) -> int:
    from transformers import AutoTokenizer

    return int(AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<|0.00|>"))


@pytest.mark.slow
def test_a_long_clips_segments_are_placed_in_the_clip(whisper: tuple[Path, Any]) -> None:
    """The 65 s clip with timestamps: each window decodes as transformers does alone, and the joined choice's segments
    are each window's moved by its start (29.45 s, 58.8 s: times and seek) and by the tokens before it."""
    from engine_server.multimodal.clip_windows import window_wav

    folder, model = whisper
    audio, samples = long_clip()
    prompt = TranscriptionPrompt(audio, "en", timestamps=True)
    windows = [dataclasses.replace(prompt, audio=window_wav(samples[a:b], 16_000))
               for a, b in itertools.pairwise(LONG_CUTS)]  # fmt: skip
    expected = [reference_timestamps(folder, model, window, 30)[1] for window in windows]
    with engine_in(folder) as llm:
        (joined,) = llm.generate([prompt], dataclasses.replace(GREEDY, max_tokens=30), use_tqdm=False)
        alone = llm.generate(windows, dataclasses.replace(GREEDY, max_tokens=30), use_tqdm=False)
    assert [r.choices[0].token_ids for r in alone] == expected
    moved = []
    before = 0
    for result, start in zip(alone, (0.0, 29.45, 58.8), strict=True):
        moved += [(round(s.start + start, 3), round(s.end + start, 3), s.text, s.token_ids, s.first_token + before,
                   round(start * 100)) for s in result.choices[0].segments]  # fmt: skip
        before += len(result.choices[0].token_ids)
    got = [(s.start, s.end, s.text, s.token_ids, s.first_token, s.seek) for s in joined.choices[0].segments]
    assert got == moved and {s.seek for s in joined.choices[0].segments} == {0, 2945, 5880}


@pytest.mark.slow
def test_timestamps_over_grpc_generate_and_stream(whisper: tuple[Path, Any]) -> None:
    """Over the servicer: Generate with `timestamps` answers each choice's segments as the offline engine reads them;
    Stream sends them on the choice's last delta alone; `Transcription.timestamps` converts."""
    from engine_server.server.convert import prompt_from_input
    from ladle.v1 import types_pb2

    folder, _ = whisper
    prompt = dataclasses.replace(CASES["transcribe"](), timestamps=True)
    message = types_pb2.Input(transcription=types_pb2.Transcription(
        audio=types_pb2.Audio(data=prompt.audio), language="en", timestamps=True))  # fmt: skip
    assert prompt_from_input(message) == prompt
    sampling = types_pb2.SamplingParams(temperature=0.0, max_tokens=40)
    with engine_in(folder) as llm:
        (offline,) = llm.generate([prompt], dataclasses.replace(GREEDY, max_tokens=40), use_tqdm=False)

    whole, stream = generate_and_stream(folder, message, sampling)
    segments = [(s.start, s.end, s.text, list(s.token_ids), s.first_token) for s in offline.choices[0].segments]
    assert segments

    def read(found: Any) -> list[tuple[float, float, str, list[int], int]]:
        return [(round(s.start_seconds, 3), round(s.end_seconds, 3), s.text, list(s.token_ids), s.first_token)
                for s in found]  # fmt: skip

    assert read(whole.choices[0].segments) == segments
    deltas = [choice for m in stream for choice in m.choices]
    assert read(deltas[-1].segments) == segments and not any(d.segments for d in deltas[:-1])
    assert "".join(d.text for d in deltas) == whole.choices[0].text == offline.choices[0].text


@pytest.mark.slow
def test_timestamps_on_a_vocabulary_without_them_are_refused(tmp_path: Path) -> None:
    """A checkpoint whose vocabulary has no timestamp tokens refuses a timestamped transcription by name, and serves
    one without."""
    save_whisper(tmp_path)
    prompt = CASES["transcribe"]()
    with engine_in(tmp_path) as llm:
        with pytest.raises(ValidationError, match="no timestamp tokens") as refused:
            llm.generate([dataclasses.replace(prompt, timestamps=True)], GREEDY, use_tqdm=False)
        assert refused.value.param == "input.transcription.timestamps"
        (result,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert len(result.choices[0].token_ids) == NEW_TOKENS and not result.choices[0].segments
