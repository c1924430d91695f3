"""Audio as input (`engine_server.multimodal.audio`): a tiny Qwen2-Audio checkpoint saved by transformers (a 2-layer
Whisper-style tower, its projector, a random Qwen2 text model; the tokenizer's `<|AUDIO|>` marks, its template's
"Audio n:" lines, a 128-bin Whisper feature extractor) served on the float path. The oracle is transformers itself: its
`Qwen2AudioProcessor` lays out the same prompt ids (each clip's placeholder expanded to its pooled frames' tokens) and
`Qwen2AudioForConditionalGeneration` gives the same greedy tokens, for one clip, two, batched, prefilled in chunks
that cut through a clip's tokens, over two tensor-parallel ranks, and from the prefix cache (another clip behind the
same ids never hits). transformers gets each clip as the engine hears it: decoded by soundfile, mixed down to mono,
resampled to 16 kHz by soxr (a 16 kHz mono WAV needs neither). What the engine cannot hear is refused by name.

Audio Flamingo 3 the same way (its `AudioFlamingo3Processor` and `AudioFlamingo3ForConditionalGeneration`; a 2-layer
tower, its projector, a random Qwen2 text model, the tokenizer's `<sound>`), a clip longer than 30 s heard in two
windows and one past the processor's `max_audio_len` refused; its encoder's rows equal `get_audio_features`'."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.vl_checkpoints import save_drawn, vision_tokenizer
from engine_server.errors import ValidationError
from engine_server.frontend import ChatPrompt
from engine_server.llm import LLM
from engine_server.tokenizer.chat import ChatAudio, ChatImage, ChatMessage
from tests.families import _SHAPE
from tests.unit.test_family_engines import engine
from tests.unit.test_image_input import GREEDY, NEW_TOKENS, png, template_turns, transformers_greedy

pytestmark = pytest.mark.slow  # engines and transformers' models of their own

RATE = 16_000
_MARKS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
# Qwen2-Audio's own template's form: each clip an "Audio n:" line where it stands among the turn's parts.
TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'audio' %}{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TOWER = {"d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64, "num_mel_bins": 128}


def clip(seed: int, seconds: float, rate: int = RATE, channels: int = 1, fmt: str = "WAV") -> bytes:
    """A random audio file: tones (other ones in each channel) and noise of `seconds` at `rate`, `channels` channels,
    in `fmt`."""
    import soundfile

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate))[:, None] / rate
    tones = sum(np.sin(2 * np.pi * f * t) for f in rng.uniform(100, 2000, (3, channels)))  # (each channel its own)
    wave = 0.3 * tones + 0.05 * rng.standard_normal((t.shape[0], channels))
    out = io.BytesIO()
    soundfile.write(out, wave.astype(np.float32), rate, format=fmt)
    return out.getvalue()


def heard(data: bytes) -> np.ndarray[Any, np.dtype[np.float32]]:
    """A clip as the engine hears it (decoded, mixed down to mono, resampled to 16 kHz)."""
    import soundfile
    import soxr

    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    mono = samples.mean(axis=1, dtype=np.float32)
    return mono if rate == RATE else soxr.resample(mono, rate, RATE).astype(np.float32)


def save_qwen2_audio(folder: Path) -> Any:
    """A tiny Qwen2-Audio checkpoint saved in `folder` as transformers saves it; returns the model."""
    import transformers
    from transformers import WhisperFeatureExtractor

    tokenizer = vision_tokenizer(folder, _MARKS, TEMPLATE)
    audio_token = int(tokenizer.convert_tokens_to_ids("<|AUDIO|>"))
    text = {**_SHAPE, "model_type": "qwen2", "vocab_size": audio_token + 8}
    config = transformers.Qwen2AudioConfig(audio_config=_TOWER, text_config=text, audio_token_index=audio_token)
    model = save_drawn(folder, transformers.Qwen2AudioForConditionalGeneration, config,
                       lambda name: "audio_tower" in name or "projector" in name, (0.2, 0.3))  # fmt: skip
    WhisperFeatureExtractor(feature_size=128).save_pretrained(folder)
    return model


def user(*parts: str | bytes) -> ChatPrompt:
    """One user turn of text and audio clips (a `bytes` part is an audio file)."""
    content = tuple(ChatAudio(part) if isinstance(part, bytes) else part for part in parts)
    return ChatPrompt([ChatMessage("user", content_parts=content)])


def processor_inputs(folder: Path, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' `Qwen2AudioProcessor` inputs for `prompt`: its template's text and its clips, as heard."""
    from transformers import AutoFeatureExtractor, AutoTokenizer, Qwen2AudioProcessor

    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = Qwen2AudioProcessor(AutoFeatureExtractor.from_pretrained(folder), tokenizer, chat_template=TEMPLATE)
    text = processor.apply_chat_template(template_turns(prompt), add_generation_prompt=True, tokenize=False)
    clips = [heard(part.data) for m in prompt.messages for _, part in m.audio]
    inputs: dict[str, torch.Tensor] = processor(text=text, audio=clips or None, sampling_rate=RATE,
                                                return_tensors="pt", add_special_tokens=False)  # fmt: skip
    return inputs


PROMPTS = {
    "one clip": lambda: user("What do you hear?", clip(1, 1.5)),
    "clip first": lambda: user(clip(2, 0.7), "Describe it."),
    "two clips": lambda: user("Compare", clip(3, 2.0), "with", clip(4, 1.1, 44_100, 2, "FLAC"), "please."),
}


@pytest.fixture(scope="module")
def qwen2_audio(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("qwen2-audio")
    return folder, save_qwen2_audio(folder)


@pytest.fixture(scope="module")
def served(qwen2_audio: tuple[Path, Any]) -> Iterator[LLM]:
    with engine(qwen2_audio[0]) as llm:
        yield llm


def audio_prompts() -> list[ChatPrompt]:
    """Every case of `PROMPTS`, then a turn with no clip."""
    return [*(PROMPTS[case]() for case in sorted(PROMPTS)), ChatPrompt([ChatMessage("user", "No sound here.")])]


@pytest.mark.parametrize(("chunk", "tensor_parallel_size"), [(2048, 1), (7, 1), (20, 2)])
def test_a_qwen2_audio_checkpoint_answers_audio_prompts_as_transformers_does(
    chunk: int, tensor_parallel_size: int, qwen2_audio: tuple[Path, Any]
) -> None:
    """Prompts with one clip, two (one a 44.1 kHz stereo FLAC) and none, batched, whole, in chunks of 7 and over two
    ranks in chunks of 20: the prompt's ids are the processor's, each answer transformers' for its prompt alone."""
    folder, model = qwen2_audio
    prompts = audio_prompts()
    inputs = [processor_inputs(folder, prompt) for prompt in prompts]
    expected = [transformers_greedy(model, each) for each in inputs]
    with engine(folder, chunk=chunk, tensor_parallel_size=tensor_parallel_size) as llm:
        results = llm.chat(prompts, GREEDY, use_tqdm=False)
    assert [result.prompt_token_ids for result in results] == [each["input_ids"][0].tolist() for each in inputs]
    assert [result.choices[0].token_ids for result in results] == expected
    assert all(len(result.choices[0].token_ids) == NEW_TOKENS for result in results)


def test_the_prefix_cache_keeps_apart_prompts_whose_clips_differ(qwen2_audio: tuple[Path, Any], served: LLM) -> None:
    """The same prompt again is served from the prefix cache with the same answer; a clip of the same length (the same
    ids) with other sounds is not."""
    folder, model = qwen2_audio
    first, other = user("Listen:", clip(5, 1.0)), user("Listen:", clip(6, 1.0))
    again = [served.chat([prompt], GREEDY, use_tqdm=False)[0] for prompt in (first, first, other)]
    assert again[0].prompt_token_ids == again[2].prompt_token_ids  # (equal ids: only the sounds differ)
    assert again[1].usage.cached_prompt_tokens >= 32 and again[2].usage.cached_prompt_tokens == 0
    assert again[0].choices[0].token_ids == again[1].choices[0].token_ids
    assert [r.choices[0].token_ids for r in again[1:]] == [
        transformers_greedy(model, processor_inputs(folder, prompt)) for prompt in (first, other)
    ]


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (b"not audio at all", "cannot be read"),
        (clip(7, 31.0, 8_000), "31.0 s long; this model hears at most 30 s"),
        (clip(8, 0.0), "cannot be read|empty"),
    ],
)
def test_what_the_engine_cannot_hear_is_refused_by_name(served: LLM, part: bytes, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as refused:
        served.chat([user("Hear this", part)], GREEDY, use_tqdm=False)
    assert refused.value.param == "messages[0].content[1]"
    (result,) = served.chat([PROMPTS["one clip"]()], GREEDY, use_tqdm=False)  # (the engine serves on)
    assert len(result.choices[0].token_ids) == NEW_TOKENS


def test_audio_outside_a_user_turn_an_image_or_a_model_without_ears_is_refused(served: LLM, tmp_path: Path) -> None:
    system = ChatMessage("system", content_parts=("Sound:", ChatAudio(clip(9, 0.5))))
    with pytest.raises(ValidationError, match="audio is heard in user turns only"):
        served.chat([ChatPrompt([system, ChatMessage("user", "Hi")])], GREEDY, use_tqdm=False)
    image = ChatPrompt([ChatMessage("user", content_parts=("See", ChatImage(png(1))))])
    with pytest.raises(ValidationError, match="images are not served for qwen2_audio"):
        served.chat([image], GREEDY, use_tqdm=False)
    with engine(tmp_path_text_model(tmp_path)) as llm, pytest.raises(ValidationError, match="hears no audio"):
        llm.chat([PROMPTS["one clip"]()], GREEDY, use_tqdm=False)


def tmp_path_text_model(folder: Path) -> Path:
    """A text-only Llama checkpoint in `folder`."""
    from tests.families import save_family

    return save_family(folder / "text", "llama")


# Audio Flamingo 3: its `<sound>` token where each clip stands among the turn's parts (its own template's form).
AF3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'audio' %}<sound>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_AF3_TOWER = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
AF3_MAX_SECONDS = 60  # (the processor's `max_audio_len` saved with the checkpoint: two 30 s windows)


def save_audio_flamingo_3(folder: Path) -> Any:
    """A tiny Audio Flamingo 3 checkpoint saved in `folder` as transformers saves it (its processor too, with its
    feature extractor and `max_audio_len` 60 s, in `processor_config.json`); returns the model."""
    import transformers
    from transformers import WhisperFeatureExtractor

    tokenizer = vision_tokenizer(folder, ["<sound>"], AF3_TEMPLATE)
    sound = int(tokenizer.convert_tokens_to_ids("<sound>"))
    text = {**_SHAPE, "model_type": "qwen2", "vocab_size": sound + 8}
    config = transformers.AudioFlamingo3Config(audio_config=_AF3_TOWER, text_config=text, audio_token_id=sound)
    model = save_drawn(folder, transformers.AudioFlamingo3ForConditionalGeneration, config,
                       lambda name: "audio_tower" in name or "projector" in name, (0.2, 0.1))  # fmt: skip
    extractor = WhisperFeatureExtractor(feature_size=128)  # (saved in the processor's processor_config.json alone)
    transformers.AudioFlamingo3Processor(extractor, tokenizer, max_audio_len=AF3_MAX_SECONDS).save_pretrained(folder)
    return model


def af3_processor_inputs(folder: Path, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' `AudioFlamingo3Processor` inputs for `prompt`: its template's text and its clips, as heard. (Its
    own check takes one clip a text; its model takes any number, each clip's windows in order: the base class's check
    is used, and its placeholders are expanded clip after clip as in one clip's call.)"""
    from transformers import AudioFlamingo3Processor, AutoFeatureExtractor, AutoTokenizer
    from transformers.processing_utils import ProcessorMixin

    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = AudioFlamingo3Processor(AutoFeatureExtractor.from_pretrained(folder), tokenizer,
                                        chat_template=AF3_TEMPLATE, max_audio_len=AF3_MAX_SECONDS)  # fmt: skip
    processor.validate_inputs = ProcessorMixin.validate_inputs.__get__(processor)  # type: ignore[method-assign]
    text = processor.apply_chat_template(template_turns(prompt), add_generation_prompt=True, tokenize=False)
    clips = [heard(part.data) for m in prompt.messages for _, part in m.audio]
    inputs = processor(text=[text], audio=clips or None, sampling_rate=RATE, add_special_tokens=False)
    return {key: value for key, value in inputs.items() if key != "num_audio_tokens"}


def joined(*parts: bytes) -> bytes:
    """One WAV file of `parts` (WAV files at one rate) one after the other."""
    import soundfile

    decoded = [soundfile.read(io.BytesIO(part), dtype="float32", always_2d=True) for part in parts]
    out = io.BytesIO()
    soundfile.write(out, np.concatenate([samples for samples, _ in decoded]), decoded[0][1], format="WAV")
    return out.getvalue()


AF3_PROMPTS = {
    "one clip": lambda: user("What do you hear?", clip(11, 1.5)),
    # (two windows of other sounds, the second 5 s)
    "a long clip first": lambda: user(joined(clip(12, 30.0, 4_000), clip(16, 5.0, 4_000)), "Describe it."),
    "two clips": lambda: user("Compare", clip(13, 2.0), "with", clip(14, 1.1, 44_100, 2, "FLAC"), "please."),
    "none": lambda: ChatPrompt([ChatMessage("user", "No sound here.")]),
}


@pytest.fixture(scope="module")
def audio_flamingo_3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("audio-flamingo-3")
    return folder, save_audio_flamingo_3(folder)


@pytest.mark.parametrize(("chunk", "tensor_parallel_size"), [(2048, 1), (7, 1), (20, 2)])
def test_an_audio_flamingo_3_checkpoint_answers_audio_prompts_as_transformers_does(
    chunk: int, tensor_parallel_size: int, audio_flamingo_3: tuple[Path, Any]
) -> None:
    """Prompts with one clip, a 35 s one (two windows), two (one a 44.1 kHz stereo FLAC) and none, batched, whole, in
    chunks of 7 and over two ranks in chunks of 20: the prompt's ids are the processor's, each answer transformers'
    for its prompt alone."""
    folder, model = audio_flamingo_3
    prompts = [AF3_PROMPTS[case]() for case in sorted(AF3_PROMPTS)]
    inputs = [af3_processor_inputs(folder, prompt) for prompt in prompts]
    assert [int(each["input_features"].shape[0]) for each in inputs if "input_features" in each] == [2, 1, 2]
    expected = [transformers_greedy(model, each) for each in inputs]
    with engine(folder, chunk=chunk, tensor_parallel_size=tensor_parallel_size) as llm:
        results = llm.chat(prompts, GREEDY, use_tqdm=False)
        if tensor_parallel_size == 1 and chunk == 7:  # (past the processor's maximum: refused by name)
            with pytest.raises(ValidationError, match=r"61\.0 s long; this model hears at most 60 s") as refused:
                llm.chat([user("Hear this", clip(15, 61.0, 2_000))], GREEDY, use_tqdm=False)
            assert refused.value.param == "messages[0].content[1]"
    assert [result.prompt_token_ids for result in results] == [each["input_ids"][0].tolist() for each in inputs]
    assert [result.choices[0].token_ids for result in results] == expected
    assert all(len(result.choices[0].token_ids) == NEW_TOKENS for result in results)


def test_audio_flamingo_3s_encoder_gives_transformers_rows_window_after_window(
    audio_flamingo_3: tuple[Path, Any],
) -> None:
    """Each clip as the engine lays it out (`AudioProcessing.prepare`: its windows, each window's valid frames) through
    the engine's encoder (loaded from the checkpoint's tensors) gives transformers' own rows for the prompt's clips,
    in order (`get_audio_features` on the processor's inputs), as many as the clip's tokens."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from engine_server.config import AudioInput
    from engine_server.multimodal.audio import AudioFlamingo3AudioEncoder, AudioProcessing, PromptAudio

    folder, model = audio_flamingo_3
    prompt = user("Compare", joined(clip(12, 30.0, 4_000), clip(16, 5.0, 4_000)), "with", clip(13, 2.0))
    inputs = af3_processor_inputs(folder, prompt)
    with torch.inference_mode():
        theirs = model.get_audio_features(inputs["input_features"], inputs["input_features_mask"]).pooler_output
    hearing = AudioProcessing.for_model(AudioInput("audioflamingo3", int(model.config.audio_token_id)), folder,
                                        AutoTokenizer.from_pretrained(folder))  # fmt: skip
    clips = [PromptAudio(part.data, "clip") for m in prompt.messages for _, part in m.audio]
    placeholders = [int(model.config.audio_token_id)] * len(clips)
    ids, spans = hearing.prepare(placeholders, clips)
    weights = load_file(folder / "model.safetensors").items()
    encoder = AudioFlamingo3AudioEncoder.from_checkpoint(folder, weights, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        ours = torch.cat([encoder.encode(span.pixel_values, span.grid) for span in spans.images])
    assert spans.images[0].grid == tuple(int(n) for n in inputs["input_features_mask"][:2].sum(-1))  # (its 2 windows)
    assert len(ids) == ours.shape[0] == theirs.shape[0] and sum(span.length for span in spans.images) == len(ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
