"""Whisper's transcription prompts (`Input.transcription`): the decoder prompt transformers' `generate` lays out
(`WhisperTranscription.prepare`) and the clip as its encoder takes it (`multimodal.whisper`).

The prompt: `<|startofprev|>` and the previous text's tokens where a `TranscriptionPrompt.prompt` is given (as
`WhisperTokenizer.get_prompt_ids` makes them), then `<|startoftranscript|>`, the language token, the task token and
`<|notimestamps|>`, their ids from `generation_config.json` (`decoder_start_token_id`, `lang_to_id`, `task_to_id`,
`no_timestamps_token_id`, `prev_sot_token_id`), else the tokenizer's (an English-only checkpoint, without
`lang_to_id`: no language or task token, as `generate` lays it out). A request without a language first runs a
one-token detection request (`detection`: `<|startoftranscript|>` alone, every token but the languages' suppressed:
transformers' `detect_language`). Its outputs have generation_config's `suppress_tokens` suppressed throughout and its
`begin_suppress_tokens` at the first (`SamplingParams.suppress_token_ids`, `begin_suppress_token_ids`), as `generate`
does. A clip longer than the encoder's window (30 s) is served as its windows (`WhisperTranscription.windows`,
`clip_windows`), each a transcription of its own, up to `max_clip_seconds`. Runs in the frontend, off the step loop.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_server.errors import ValidationError
from engine_server.multimodal.audio import PromptAudio, decoded_clip
from engine_server.multimodal.clip_windows import split_clip, window_wav
from engine_server.multimodal.inputs import ImageSpan, MultimodalInputs, image_digest

_PROCESSOR_CONFIG = "preprocessor_config.json"
_GENERATION_CONFIG = "generation_config.json"
_TASKS = ("transcribe", "translate")
MAX_CLIP_SECONDS = 3600.0  # the longest clip served (in windows: `WhisperTranscription.windows`)


@dataclass(frozen=True)
class TranscriptionPrompt:
    """A clip to write down (`Input.transcription`): its encoded file, its language (an ISO code, a name transformers
    knows, or "" to detect it), the task ("transcribe" or "translate") and the text before it ("" for none)."""

    audio: bytes
    language: str = ""
    task: str = "transcribe"
    prompt: str = ""


@dataclass(frozen=True)
class TranscriptionInfo:
    """What a transcription's caller learns of its clip: the language's ISO code and the clip's seconds as decoded."""

    language: str
    duration_seconds: float


@dataclass(frozen=True)
class PreparedTranscription:
    """A transcription's decoder prompt, its clip as the encoder takes it, what its caller learns, and the tokens its
    outputs suppress (always; at the first output)."""

    token_ids: list[int]
    clip: MultimodalInputs
    info: TranscriptionInfo
    suppress_token_ids: tuple[int, ...]
    begin_suppress_token_ids: tuple[int, ...]


class WhisperTranscription:
    """The prompts of a Whisper checkpoint (its feature extractor, generation config and tokenizer). Thread-safe: it
    holds no state but their settings."""

    def __init__(
        self, extractor: Any, generation: dict[str, Any], tokenizer: Any, max_clip_seconds: float = MAX_CLIP_SECONDS
    ) -> None:
        self.extractor = extractor
        self.max_clip_seconds = max_clip_seconds  # a longer clip is refused by name (`windows`)
        self.tokenizer = tokenizer
        self.sampling_rate = int(extractor.sampling_rate)
        self.max_seconds = float(extractor.n_samples) / self.sampling_rate  # the encoder's one window (30 s)

        def token(key: str, text: str) -> int:
            value = generation.get(key)
            return int(value) if value is not None else int(tokenizer.convert_tokens_to_ids(text))

        self.start = token("decoder_start_token_id", "<|startoftranscript|>")
        self.previous = token("prev_sot_token_id", "<|startofprev|>")
        self.no_timestamps = token("no_timestamps_token_id", "<|notimestamps|>")
        tasks = generation.get("task_to_id") or {}
        self.tasks = {task: int(tasks[task]) if task in tasks else token("", f"<|{task}|>") for task in _TASKS}
        self.languages: dict[str, int] = {str(k): int(v) for k, v in (generation.get("lang_to_id") or {}).items()}
        # An English-only checkpoint (`.en`: no `lang_to_id`): its prompt has no language or task token, as
        # transformers' `generate` lays it out; it transcribes English alone.
        self.english_only = not self.languages
        self.suppress = tuple(int(t) for t in generation.get("suppress_tokens") or ())
        self.begin_suppress = tuple(int(t) for t in generation.get("begin_suppress_tokens") or ())
        self.special_ids = frozenset(int(i) for i in tokenizer.all_special_ids) | frozenset(self.languages.values())

    @classmethod
    def for_model(
        cls, folder: Path, tokenizer: Any, max_clip_seconds: float = MAX_CLIP_SECONDS
    ) -> WhisperTranscription:
        """The prompts of the checkpoint in `folder` (clips up to `max_clip_seconds`)."""
        from transformers import WhisperFeatureExtractor

        extractor = WhisperFeatureExtractor.from_pretrained(str(folder))
        path = folder / _GENERATION_CONFIG
        generation = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        return cls(extractor, generation, tokenizer, max_clip_seconds)

    def language_code(self, language: str) -> str:
        """The ISO code of `language` (a code, `<|code|>`, or a name transformers knows: `TO_LANGUAGE_CODE`);
        ValidationError naming one this model has no token for."""
        from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

        key = language.strip().lower().removeprefix("<|").removesuffix("|>")
        code = TO_LANGUAGE_CODE.get(key, key)
        if self.english_only and code in ("", "en"):
            return "en"
        if self.english_only:
            raise ValidationError(f"language {language!r}: this Whisper model is English-only (it transcribes English "
                                  "alone)", "input.transcription.language")  # fmt: skip
        if f"<|{code}|>" not in self.languages:
            raise ValidationError(f"language {language!r} is not one this model knows (an ISO code such as "
                                  "'en', or a name such as 'english')", "input.transcription.language")  # fmt: skip
        return code

    def code_of(self, token_id: int) -> str:
        """The ISO code of a language token's id."""
        return next(key[2:-2] for key, each in self.languages.items() if each == token_id)

    def prepare(self, prompt: TranscriptionPrompt, language: str) -> PreparedTranscription:
        """`prompt`'s decoder prompt in `language` (an ISO code this model knows) and its clip; ValidationError for a
        task other than transcribe or translate, a previous text holding a special token, or a clip that is no
        audio, empty or longer than the window (named with its length)."""
        if prompt.task not in _TASKS or (self.english_only and prompt.task != "transcribe"):
            served = "transcribe (an English-only model)" if self.english_only else ", ".join(_TASKS)
            raise ValidationError(f"task {prompt.task!r} is not served: {served}", "input.transcription.task")
        clip, info = self._clip(prompt.audio, language)
        if self.english_only:
            ids = [*self._previous_text(prompt.prompt), self.start, self.no_timestamps]
        else:
            ids = [*self._previous_text(prompt.prompt), self.start, self.languages[f"<|{language}|>"],
                   self.tasks[prompt.task], self.no_timestamps]  # fmt: skip
        return PreparedTranscription(ids, clip, info, self.suppress, self.begin_suppress)

    def windows(self, prompt: TranscriptionPrompt) -> tuple[list[TranscriptionPrompt], float] | None:
        """None where `prompt`'s clip fits the encoder's window (`max_seconds`: it runs as it is, `prepare`), or is no
        audio (refused by `prepare`); else its windows (`clip_windows.split_clip` on the clip decoded once at the
        model's rate, each a float32 WAV of its own: its own digest) as transcriptions of their own with `prompt`'s
        language, task and previous text, and the whole clip's seconds. ValidationError for a clip longer than
        `max_clip_seconds` (named with its length)."""
        import soundfile

        try:
            info = soundfile.info(io.BytesIO(prompt.audio))
        except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError):
            return None
        if not info.samplerate or info.frames / info.samplerate <= self.max_seconds:
            return None
        samples, seconds = decoded_clip(PromptAudio(prompt.audio, "input.transcription.audio"), self.sampling_rate,
                                        self.max_clip_seconds)  # fmt: skip
        cuts = split_clip(samples, self.sampling_rate, self.max_seconds)
        return [dataclasses.replace(prompt, audio=window_wav(samples[start:end], self.sampling_rate))
                for start, end in cuts], seconds  # fmt: skip

    def detection(self, prompt: TranscriptionPrompt, vocab_size: int) -> PreparedTranscription:
        """The one-token request that detects `prompt`'s language: `<|startoftranscript|>` alone, every token of the
        model's `vocab_size` but the languages' suppressed (its output the language token, as transformers'
        `detect_language` picks it)."""
        clip, info = self._clip(prompt.audio, "", detection=True)
        return PreparedTranscription([self.start], clip, info, self._not_languages(vocab_size), ())

    @functools.cache  # noqa: B019  (one entry a model: its vocabulary size; the instance lives as long as the engine)
    def _not_languages(self, vocab_size: int) -> tuple[int, ...]:
        """Every token id below `vocab_size` but the languages' (a detection's suppressed tokens), made once."""
        allowed = set(self.languages.values())
        return tuple(t for t in range(vocab_size) if t not in allowed)

    def _previous_text(self, text: str) -> list[int]:
        """`<|startofprev|>` and the previous text's tokens (" " + the text stripped), as `get_prompt_ids` makes them;
        [] for no text. ValidationError where the text spells a special token."""
        if not text.strip():
            return []
        ids = [int(t) for t in self.tokenizer.encode(" " + text.strip(), add_special_tokens=False)]
        special = next((t for t in ids if t in self.special_ids), None)
        if special is not None:
            raise ValidationError(f"the previous text may not hold the special token "
                                  f"{self.tokenizer.convert_ids_to_tokens(special)!r}", "input.transcription.prompt")
        return [self.previous, *ids]

    def _clip(self, data: bytes, language: str, detection: bool = False) -> tuple[MultimodalInputs, TranscriptionInfo]:
        """The clip as the encoder takes it (a language `detection`'s: its states kept for the transcription after
        it) and what the caller learns of it; ValidationError as `prepare`."""
        samples, seconds = decoded_clip(PromptAudio(data, "input.transcription.audio"), self.sampling_rate,
                                        self.max_seconds)  # fmt: skip
        features = self.extractor(samples, sampling_rate=self.sampling_rate, return_tensors="pt").input_features
        span = ImageSpan(0, 0, features, image_digest(data))
        return MultimodalInputs((span,), transcription=True, detects_language=detection), TranscriptionInfo(language,
                                                                                                            seconds)


def silent_clip(seconds: float = 1.0, rate: int = 16_000) -> bytes:
    """`seconds` of silence as a WAV file (an engine's warm-up transcription)."""
    import io

    import numpy as np
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, np.zeros(int(seconds * rate), dtype=np.float32), rate, format="WAV")
    return out.getvalue()


def transcription_refusal(transcribes: bool, folder: Path) -> str:
    """Why the model in `folder` writes no clip down (`transcribes`: `MultimodalCheckpoint.transcribes`); "" where
    it does (then its encoder loads: `engine_server.model_loading`)."""
    if not transcribes:
        return "this model does not transcribe audio (Input.transcription is served for Whisper checkpoints)"
    if not (folder / _PROCESSOR_CONFIG).is_file():
        return f"this Whisper checkpoint has no feature extractor ({_PROCESSOR_CONFIG}) to hear its clips with"
    return ""


def served_transcription(
    transcribes: bool, folder: Path, tokenizer: Any, max_clip_seconds: float = MAX_CLIP_SECONDS
) -> tuple[WhisperTranscription | None, str]:
    """The prompts of the model in `folder` where it transcribes (`MultimodalCheckpoint.transcribes`; clips up to
    `max_clip_seconds`: `EngineConfig.max_transcription_seconds`), and the refusal of a transcription where it does not
    (`transcription_refusal`)."""
    refusal = transcription_refusal(transcribes, folder)
    if refusal:
        return None, refusal
    return WhisperTranscription.for_model(folder, tokenizer, max_clip_seconds), ""
