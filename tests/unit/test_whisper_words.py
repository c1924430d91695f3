"""Whisper's word timings (`Transcription.word_timestamps`, `multimodal.word_timing`): the warping path and the median
filter equal transformers' own (random and tied costs); on the tiny random Whisper of `test_whisper`, given
`alignment_heads`, each word's times are those transformers' `generate(return_token_timestamps=True)` gives its tokens
(with the clip's attention mask), its words grouped by its Whisper tokenizer: transcribe, translate, a previous text,
batched with a plain request, whole and in prefill chunks of 3, preempted and recomputed in a small KV pool, a long
clip's windows (moved by their starts), and over gRPC. A checkpoint naming no alignment heads refuses them by name."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine_server.errors import ValidationError
from engine_server.multimodal.transcription import TranscriptionPrompt
from engine_server.multimodal.word_timing import dynamic_time_warping, median_filter
from engine_server.sampling_params import SamplingParams
from tests.unit.test_audio_input import clip, heard
from tests.unit.test_whisper import (
    CASES,
    LANGUAGES,
    LONG_CUTS,
    engine_in,
    generate_and_stream,
    long_clip,
    save_whisper,
)

HEADS = [[1, 0], [1, 2], [0, 3]]  # (layer, head): transformers stacks them in this order
NEW = 24


def test_the_warping_path_and_the_filter_are_transformers() -> None:
    """`dynamic_time_warping` (an anti-diagonal at a time) gives transformers' path on random costs and on costs with
    ties (its order of preference among equal costs), for shapes thin and wide; `median_filter` its filter."""
    from transformers.models.whisper.generation_whisper import _dynamic_time_warping, _median_filter

    rng = np.random.default_rng(0)
    for shape, tied in itertools.product([(1, 4), (4, 1), (7, 30), (40, 75), (90, 300)], (False, True)):
        matrix = rng.standard_normal(shape)
        matrix = np.round(matrix) if tied else matrix
        ours, theirs = dynamic_time_warping(matrix), _dynamic_time_warping(matrix)
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True)), (shape, tied)
    values = torch.randn(3, 10, 40)
    assert torch.equal(median_filter(values, 7), _median_filter(values, 7))
    assert torch.equal(median_filter(values[..., :3], 7), values[..., :3])  # (no wider than half: as it is)


def test_words_are_made_of_text_tokens_timed_by_their_place(tmp_path: Path) -> None:
    """Timestamp and special tokens between the words make none (nor the end token), and each word's times are its
    tokens' by their places in the whole decode (a diagonal attention: token i's row takes frames 2i and 2i + 1)."""
    from engine_server.multimodal.word_timing import WordTiming, token_times
    from tests.unit.test_whisper import whisper_tokenizer

    tokenizer = whisper_tokenizer(tmp_path, timestamps=True)
    begin, eos = tokenizer.convert_tokens_to_ids("<|0.00|>"), tokenizer.eos_token_id
    the, cat, at = (tokenizer.encode(word, add_special_tokens=False)[0] for word in (" the", " cat", " a"))
    ids = [begin, the, cat, begin + 50, tokenizer.convert_tokens_to_ids("<|de|>"), at, eos]
    attention = torch.zeros(1, len(ids) - 1, 2 * (len(ids) - 1))
    for row in range(len(ids) - 1):
        attention[0, row, 2 * row : 2 * row + 2] = 1.0
    times = token_times(attention, 3, len(ids))
    words = WordTiming(3, "english", 10.0).words(tokenizer, ids, eos, attention)
    assert [w.word for w in words] == [" the", " cat", " a"]
    assert [(w.start, w.end) for w in words] == [(round(10 + times[1], 3), round(10 + times[2], 3)),
                                                 (round(10 + times[2], 3), round(10 + times[3], 3)),
                                                 (round(10 + times[5], 3), round(10 + times[6], 3))]
    assert times == sorted(times) and len(set(times)) > 3  # (the diagonal: each token later than the one before)


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The tiny Whisper with `alignment_heads` in its generation config, its tokens that start a word (a leading
    space) drawn larger in its tied embeddings and head, so that its outputs hold several words."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("whisper")
    model = save_whisper(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    spaced = [i for token, i in tokenizer.get_vocab().items() if token.startswith("Ġ") and len(token) > 1]
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight[spaced] *= 3.0
    model.save_pretrained(folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "alignment_heads": HEADS}))
    model.generation_config.alignment_heads = HEADS
    return folder, model


def reference_words(folder: Path, model: Any, prompt: TranscriptionPrompt, new: int = NEW) -> list[tuple[str, float,
                                                                                                         float]]:
    """transformers' words of `prompt` (language given): its greedy tokens and their times from `generate(
    return_token_timestamps=True)` with the clip's attention mask, the text tokens grouped by its tokenizer's
    `_combine_tokens_into_words`, each word from its first token's time to the next token's (its last's, at the end),
    moved by `prompt.offset_seconds`."""
    from transformers import AutoTokenizer, WhisperFeatureExtractor
    from transformers.models.whisper.tokenization_whisper import LANGUAGES as NAMES
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE, _combine_tokens_into_words

    tokenizer = AutoTokenizer.from_pretrained(folder)
    found = WhisperFeatureExtractor.from_pretrained(folder)(heard(prompt.audio), sampling_rate=16_000,
                                                            return_tensors="pt", return_attention_mask=True)
    kwargs: dict[str, Any] = {"task": prompt.task, "language": prompt.language}
    if prompt.prompt:
        kwargs["prompt_ids"] = torch.tensor([int(t) for t in tokenizer.get_prompt_ids(prompt.prompt)])
    with torch.inference_mode():
        out = model.generate(found.input_features, attention_mask=found.attention_mask, return_token_timestamps=True,
                             max_new_tokens=new, do_sample=False, **kwargs)  # fmt: skip
    tokens = [int(t) for t in out["sequences"][0]]
    times = [float(t) for t in out["token_timestamps"][0]]
    eos = model.generation_config.eos_token_id
    ends = len(tokens) - 1 if tokens and tokens[-1] == eos else len(tokens)
    places = [i for i in range(ends) if tokens[i] < eos]
    language = NAMES[TO_LANGUAGE_CODE.get(prompt.language, prompt.language)]
    words, _, indices = _combine_tokens_into_words(tokenizer, [tokens[i] for i in places], language)
    result = []
    for word, where in zip(words, indices, strict=True):
        if where:
            first, last = places[where[0]], places[where[-1]]
            end = times[last + 1] if last + 1 < len(times) else times[last]
            result.append((word, round(prompt.offset_seconds + times[first], 3), round(prompt.offset_seconds + end, 3)))
    return result


def words_of(result: Any) -> list[tuple[str, float, float]]:
    return [(w.word, w.start, w.end) for w in result.choices[0].words]


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [2048, 3])
def test_word_times_equal_transformers(whisper: tuple[Path, Any], chunk: int) -> None:
    """Transcribe, translate and a previous text asking word timings, beside the same clip plain: each word and its
    times are transformers', and the plain request has none."""
    folder, model = whisper
    clips = [dataclasses.replace(CASES[case](), word_timestamps=True) for case in ("transcribe", "translate")]
    clips.append(dataclasses.replace(CASES["previous text"](), word_timestamps=True))
    expected = [reference_words(folder, model, prompt) for prompt in clips]
    with engine_in(folder, chunk=chunk) as llm:
        results = llm.generate([*clips, CASES["transcribe"]()], SamplingParams(temperature=0.0, max_tokens=NEW),
                               use_tqdm=False)  # fmt: skip
    assert [words_of(result) for result in results[:3]] == expected
    assert sum(len(words) for words in expected) > 3 and any(start > 0 for w in expected for _, start, _ in w[1:])
    assert not results[3].choices[0].words


@pytest.mark.slow
def test_preempted_requests_keep_their_word_times(whisper: tuple[Path, Any]) -> None:
    """Eight clips asking word timings in a pool of 10 blocks, 8 tokens a step: preempted and recomputed (their rows'
    attention written again), each one's words are transformers'."""
    folder, model = whisper
    batch = [TranscriptionPrompt(clip(40 + i, 0.5 + 0.3 * i), LANGUAGES[i % 4], word_timestamps=True)
             for i in range(8)]  # fmt: skip
    expected = [reference_words(folder, model, prompt, 30) for prompt in batch]
    with engine_in(folder, chunk=8, kv_blocks=10) as llm:
        results = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)
        assert llm.core.scheduler.total_preemptions > 0
        states = llm.core.runner.cross_states
        assert states is not None and not states._aligned  # (each request's attention handed out or dropped)
    assert [words_of(result) for result in results] == expected


@pytest.mark.slow
def test_a_long_clips_words_are_placed_in_the_clip(whisper: tuple[Path, Any]) -> None:
    """The 65 s clip asking word timings: its words are its three windows' (each as transformers times it alone),
    moved by their starts (29.45 s and 58.8 s)."""
    from engine_server.multimodal.clip_windows import window_wav

    folder, model = whisper
    audio, samples = long_clip()
    prompt = TranscriptionPrompt(audio, "en", word_timestamps=True)
    expected = []
    for (start, end), offset in zip(itertools.pairwise(LONG_CUTS), (0.0, 29.45, 58.8), strict=False):
        window = dataclasses.replace(prompt, audio=window_wav(samples[start:end], 16_000), offset_seconds=offset)
        expected += reference_words(folder, model, window, 12)
    with engine_in(folder) as llm:
        (joined,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert words_of(joined) == expected and max(start for _, start, _ in expected) > 58.8


@pytest.mark.slow
def test_words_over_grpc(whisper: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """`Transcription.word_timestamps` over the servicer: Generate answers the words the offline engine gives; Stream
    sends them on the choice's last delta alone. Served, the words are made off the event loop (their warping takes
    up to ~0.1 s), on the tokenizer thread."""
    import threading

    from engine_server.multimodal.word_timing import WordTiming
    from ladle.v1 import types_pb2

    threads: list[str] = []
    made = WordTiming.words

    def words(self: WordTiming, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return made(self, *args, **kwargs)

    monkeypatch.setattr(WordTiming, "words", words)
    folder, _ = whisper
    prompt = dataclasses.replace(CASES["transcribe"](), word_timestamps=True)
    message = types_pb2.Input(transcription=types_pb2.Transcription(
        audio=types_pb2.Audio(data=prompt.audio), language="en", word_timestamps=True))  # fmt: skip
    with engine_in(folder) as llm:
        (offline,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=NEW), use_tqdm=False)
    whole, stream = generate_and_stream(folder, message, types_pb2.SamplingParams(temperature=0.0, max_tokens=NEW))

    def read(found: Any) -> list[tuple[str, float, float]]:
        return [(w.word, round(w.start_seconds, 3), round(w.end_seconds, 3)) for w in found]

    assert read(whole.choices[0].words) == words_of(offline) and words_of(offline)
    deltas = [choice for m in stream for choice in m.choices]
    assert read(deltas[-1].words) == words_of(offline) and not any(d.words for d in deltas[:-1])
    assert threads[0] == threading.main_thread().name  # the offline engine's, on its caller's thread
    assert len(threads) == 3 and all(name.startswith("tokenizer") for name in threads[1:])


@pytest.mark.slow
def test_a_checkpoint_without_alignment_heads_refuses_word_timings(tmp_path: Path) -> None:
    save_whisper(tmp_path)
    with engine_in(tmp_path) as llm, pytest.raises(ValidationError, match="no alignment_heads") as refused:
        llm.generate([dataclasses.replace(CASES["transcribe"](), word_timestamps=True)],
                     SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # fmt: skip
    assert refused.value.param == "input.transcription.word_timestamps"
