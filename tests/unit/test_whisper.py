"""Whisper (`engine_server.multimodal.whisper`, `models.whisper`): a tiny random `WhisperForConditionalGeneration`
(d_model 64, 2 encoder and 2 decoder layers, its matrices drawn wide so outputs vary) saved by transformers with a
`WhisperTokenizer` built offline (a byte-level BPE vocabulary of its own and Whisper's special tokens), a
`WhisperFeatureExtractor` and a generation config with `lang_to_id`, `task_to_id`, `suppress_tokens` and
`begin_suppress_tokens`. The oracle is transformers' own `model.generate(input_features, language=..., task=...,
prompt_ids=...)` on the clip as the engine hears it (decoded by soundfile, mixed down, resampled to 16 kHz by soxr):
greedy tokens equal for transcribe, translate, a previous-text prompt and a detected language, batched, prefilled in
chunks, preempted in a small KV pool, and for two clips behind the same prompt (the prefix cache keeps them apart).
The int8 default runs and gives each clip the same tokens alone as batched. What is not served is refused by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.vl_checkpoints import save_drawn
from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_server.errors import ValidationError
from engine_server.llm import LLM
from engine_server.multimodal.whisper import TranscriptionPrompt
from engine_server.sampling_params import SamplingParams
from tests.unit.test_audio_input import clip, heard
from tests.unit.test_family_engines import engine

pytestmark = pytest.mark.slow  # engines and transformers' models of their own

LANGUAGES = ("en", "de", "fr", "es")
_SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", *[f"<|{code}|>" for code in LANGUAGES], "<|translate|>",
             "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]  # fmt: skip
_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("a", "t"), ("Ġ", "c"), ("Ġc", "at")]
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
# A previous text long enough for a whole KV block of the prompt (16 tokens) before the clip's tokens.
PREVIOUS = "the cat sat at the mat, the hat at the cat"


def whisper_tokenizer(folder: Path) -> Any:
    """A `WhisperTokenizer` over a byte-level vocabulary (every byte, a few merges) and Whisper's special tokens, saved
    in `folder`."""
    import transformers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    for first, second in _MERGES:
        vocab[first + second] = len(vocab)
    tokenizer = transformers.WhisperTokenizer(vocab=vocab, merges=_MERGES)
    tokenizer.add_special_tokens({"additional_special_tokens": _SPECIALS})
    tokenizer.save_pretrained(folder)
    return tokenizer


def save_whisper(folder: Path) -> Any:
    """A tiny Whisper checkpoint saved in `folder` as transformers saves it; returns the model."""
    import transformers

    tokenizer = whisper_tokenizer(folder)
    ids = {token: int(tokenizer.convert_tokens_to_ids(token)) for token in _SPECIALS}
    eos = ids["<|endoftext|>"]
    config = transformers.WhisperConfig(
        vocab_size=len(tokenizer), d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80, max_target_positions=64,
        decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=eos, pad_token_id=eos, bos_token_id=eos,
    )  # fmt: skip
    model = save_drawn(folder, transformers.WhisperForConditionalGeneration, config, lambda name: "encoder" in name,
                       (0.25, 0.25))  # fmt: skip
    generation = transformers.GenerationConfig(
        decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=eos, pad_token_id=eos, bos_token_id=eos,
        lang_to_id={f"<|{code}|>": ids[f"<|{code}|>"] for code in LANGUAGES},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"], prev_sot_token_id=ids["<|startofprev|>"],
        is_multilingual=True, suppress_tokens=[5, 17, 66], begin_suppress_tokens=[220, eos], max_length=64,
    )  # fmt: skip
    generation.save_pretrained(folder)
    model.generation_config = generation
    transformers.WhisperFeatureExtractor(feature_size=80).save_pretrained(folder)
    return model


def reference(folder: Path, model: Any, prompt: TranscriptionPrompt, new: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy output tokens for `prompt` (its decoder prompt left out; its language detected where the
    prompt names none)."""
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    features = WhisperFeatureExtractor.from_pretrained(folder)(heard(prompt.audio), sampling_rate=16_000,
                                                               return_tensors="pt").input_features  # fmt: skip
    kwargs: dict[str, Any] = {"task": prompt.task, "language": prompt.language or None}
    if prompt.prompt:
        kwargs["prompt_ids"] = torch.tensor(AutoTokenizer.from_pretrained(folder).get_prompt_ids(prompt.prompt))
    with torch.inference_mode():
        out = model.generate(features, max_new_tokens=new, do_sample=False, **kwargs)
    tokens = [int(t) for t in out[0]]
    start = tokens.index(model.generation_config.no_timestamps_token_id) + 1 if \
        model.generation_config.no_timestamps_token_id in tokens else 0  # fmt: skip
    return tokens[start:]


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("whisper")
    return folder, save_whisper(folder)


@pytest.fixture(scope="module")
def served(whisper: tuple[Path, Any]) -> Iterator[LLM]:
    with engine(whisper[0]) as llm:
        yield llm


CASES = {
    "transcribe": lambda: TranscriptionPrompt(clip(1, 1.5), "en"),
    "translate": lambda: TranscriptionPrompt(clip(2, 2.5, 8_000), "german", "translate"),
    "previous text": lambda: TranscriptionPrompt(clip(3, 0.8, 44_100, 2, "FLAC"), "fr", prompt=PREVIOUS),
    "detected": lambda: TranscriptionPrompt(clip(4, 3.0, 22_050)),
}


def test_smoke(whisper: tuple[Path, Any], served: LLM) -> None:
    folder, model = whisper
    for name, case in CASES.items():
        prompt = case()
        (result,) = served.generate([prompt], GREEDY, use_tqdm=False)
        print(name, result.prompt_token_ids, result.choices[0].token_ids, reference(folder, model, prompt))
