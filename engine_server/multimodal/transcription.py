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

With `TranscriptionPrompt.timestamps` the prompt leaves `<|notimestamps|>` out and the decode keeps to Whisper's
timestamp rules (`SamplingParams.timestamps`, transformers' `WhisperTimeStampLogitsProcessor`); its output reads as
segments (`TimestampTokens.segments`). Timestamp tokens never reach a transcription's text, as transformers' `decode`
filters them (`TimestampTokens.begin`).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_server.errors import ValidationError
from engine_server.multimodal.audio import PromptAudio, decoded_clip
from engine_server.multimodal.clip_windows import split_clip, window_wav
from engine_server.multimodal.inputs import ImageSpan, MultimodalInputs, image_digest
from engine_server.multimodal.word_timing import WordTiming
from engine_server.sampling_params import TimestampRules

_PROCESSOR_CONFIG = "preprocessor_config.json"
_GENERATION_CONFIG = "generation_config.json"
_TASKS = ("transcribe", "translate")
MAX_CLIP_SECONDS = 3600.0  # the longest clip served (in windows: `WhisperTranscription.windows`)
TIME_PRECISION = 0.02  # seconds between two of Whisper's timestamp tokens (its 30 s over 1,500 encoder frames)
FRAMES_PER_SECOND = 100  # Whisper's `seek` unit: the feature extractor's 10 ms hop


@dataclass(frozen=True)
class TranscriptionPrompt:
    """A clip to write down (`Input.transcription`): its encoded file, its language (an ISO code, a name transformers
    knows, or "" to detect it), the task ("transcribe" or "translate") and the text before it ("" for none)."""

    audio: bytes
    language: str = ""
    task: str = "transcribe"
    prompt: str = ""
    timestamps: bool = False  # decode with timestamp tokens: the output reads as segments
    offset_seconds: float = 0.0  # where this clip starts in the caller's (a window's: `WhisperTranscription.windows`)
    temperature_fallback: bool = False  # decode again hotter while the output fails Whisper's checks (`fallback`)
    word_timestamps: bool = False  # its words' times from the alignment heads' attention (`word_timing`)


@dataclass(frozen=True)
class TranscriptionInfo:
    """What a transcription's caller learns of its clip: the language's ISO code and the clip's seconds as decoded."""

    language: str
    duration_seconds: float


@dataclass(frozen=True)
class TranscriptionSegment:
    """A stretch of speech between two timestamp tokens: its seconds into the clip, its text (Whisper's leading space
    kept), its tokens (its timestamps included), where the first sits in the choice's tokens, and its window's start
    in 10 ms frames (Whisper's `seek`)."""

    start: float
    end: float
    text: str
    token_ids: tuple[int, ...]
    first_token: int
    seek: int
    temperature: float = 0.0  # its decode's
    no_speech_prob: float | None = None  # its window's, where measured (`fallback`)

    def shifted(self, tokens: int) -> TranscriptionSegment:
        """This segment of a window whose choice follows `tokens` other tokens in a joined choice."""
        return dataclasses.replace(self, first_token=self.first_token + tokens)


@dataclass(frozen=True)
class TimestampTokens:
    """A transcription's timestamp tokens: the ids from `begin` up, `TIME_PRECISION` seconds apart (its text leaves
    them out). Where `segments` (`Transcription.timestamps`), its output reads as segments of its window
    (`offset_seconds` into the clip, `window_seconds` long: `read`)."""

    begin: int
    segments: bool = False
    offset_seconds: float = 0.0
    window_seconds: float = 0.0

    def read(
        self, token_ids: Sequence[int], stop_token: int | None, decode: Callable[[list[int]], str],
        temperature: float = 0.0,
    ) -> list[TranscriptionSegment]:
        """The segments of a decode at `temperature` of `token_ids` (its `stop_token` last, where it ended on one: in
        no segment), as
        transformers' `_compute_offsets` reads them: each opening timestamp, the text after it and the closing
        timestamp after that. A segment whose decode stopped before its closing timestamp ends at the window's end
        (its text is kept; transformers drops it), an opening timestamp with no text after it is none, and no time
        goes past the window's end. Texts are `decode`d (special tokens skipped)."""
        ids = list(token_ids[:-1] if stop_token is not None and token_ids and token_ids[-1] == stop_token
                   else token_ids)  # fmt: skip
        found: list[TranscriptionSegment] = []
        start: float | None = None
        first = 0
        for index, token in enumerate(ids):
            if token < self.begin:
                if start is None:  # text with no timestamp before it (not under the rules): from the last end
                    start, first = (found[-1].end - self.offset_seconds if found else 0.0), index
                continue
            seconds = (token - self.begin) * TIME_PRECISION
            if start is None:
                start, first = seconds, index
                continue
            found.extend(self._segment(ids, first, index + 1, start, seconds, decode))
            start = None
        if start is not None:
            found.extend(self._segment(ids, first, len(ids), start, self.window_seconds, decode))
        return [dataclasses.replace(segment, temperature=temperature) for segment in found]

    def _segment(
        self, ids: list[int], first: int, end: int, start: float, stop: float, decode: Callable[[list[int]], str]
    ) -> list[TranscriptionSegment]:
        """The segment of `ids[first:end]`, `start` to `stop` seconds into the window ([] where it holds no text)."""
        tokens = ids[first:end]
        words = [token for token in tokens if token < self.begin]
        if not words:
            return []
        start, stop = min(start, self.window_seconds), min(max(stop, start), self.window_seconds)
        return [TranscriptionSegment(round(self.offset_seconds + start, 3), round(self.offset_seconds + stop, 3),
                                     decode(words), tuple(tokens), first,
                                     round(self.offset_seconds * FRAMES_PER_SECOND))]  # fmt: skip


@dataclass(frozen=True)
class PreparedTranscription:
    """A transcription's decoder prompt, its clip as the encoder takes it, what its caller learns, the tokens its
    outputs suppress (always; at the first output), its timestamp rules (None: it decodes without), its timestamp
    tokens (None: the vocabulary has none) and how its words are timed (None: not asked)."""

    token_ids: list[int]
    clip: MultimodalInputs
    info: TranscriptionInfo
    suppress_token_ids: tuple[int, ...]
    begin_suppress_token_ids: tuple[int, ...]
    rules: TimestampRules | None = None
    timestamps: TimestampTokens | None = None
    words: WordTiming | None = None


class WhisperTranscription:
    """The prompts of a Whisper checkpoint (its feature extractor, generation config and tokenizer). Thread-safe: it
    holds no state but their settings."""

    def __init__(
        self, extractor: Any, generation: dict[str, Any], tokenizer: Any, max_clip_seconds: float = MAX_CLIP_SECONDS,
        median_filter_width: int = 7,
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
        # Timestamp tokens follow `<|notimestamps|>` (`<|0.00|>` first), as transformers' processor counts them; a
        # vocabulary without them decodes without timestamps only.
        begin = self.no_timestamps + 1
        self.timestamp_begin = begin if tokenizer.convert_ids_to_tokens(begin) == "<|0.00|>" else None
        eos = generation.get("eos_token_id") or generation.get("bos_token_id") or tokenizer.eos_token_id
        self.eos = int(eos[0] if isinstance(eos, list) else eos)
        initial = generation.get("max_initial_timestamp_index")
        self.max_initial_timestamp = None if initial is None else int(initial)
        # Whisper's silence token (`<|nocaptions|>` in the first checkpoints); None where the vocabulary has neither.
        # Word timings': the checkpoint's alignment heads (none: refused) and its median filter's width.
        self.alignment_heads = bool(generation.get("alignment_heads"))
        self.median_filter_width = median_filter_width
        self.no_speech = _token_id(tokenizer, "<|nospeech|>")
        if self.no_speech is None:
            self.no_speech = _token_id(tokenizer, "<|nocaptions|>")

    @classmethod
    def for_model(
        cls, folder: Path, tokenizer: Any, max_clip_seconds: float = MAX_CLIP_SECONDS
    ) -> WhisperTranscription:
        """The prompts of the checkpoint in `folder` (clips up to `max_clip_seconds`)."""
        from transformers import WhisperFeatureExtractor

        extractor = WhisperFeatureExtractor.from_pretrained(str(folder))
        path = folder / _GENERATION_CONFIG
        generation = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        return cls(extractor, generation, tokenizer, max_clip_seconds, int(config.get("median_filter_width", 7)))

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
        if prompt.timestamps and self.timestamp_begin is None:
            raise ValidationError("this Whisper model has no timestamp tokens (<|0.00|> after <|notimestamps|>): it "
                                  "decodes without timestamps only", "input.transcription.timestamps")  # fmt: skip
        if prompt.word_timestamps and not self.alignment_heads:
            raise ValidationError("this Whisper checkpoint names no alignment_heads (generation_config.json): it has "
                                  "no word timings", "input.transcription.word_timestamps")  # fmt: skip
        clip, info = self._clip(prompt.audio, language, words=prompt.word_timestamps)
        words = None
        if prompt.word_timestamps:
            from transformers.models.whisper.tokenization_whisper import LANGUAGES

            words = WordTiming(self.median_filter_width, LANGUAGES.get(language, "english"), prompt.offset_seconds)
        ids = [*self._previous_text(prompt.prompt), self.start]
        if not self.english_only:
            ids += [self.languages[f"<|{language}|>"], self.tasks[prompt.task]]
        if not prompt.timestamps:
            ids.append(self.no_timestamps)
        if self.timestamp_begin is None:
            return PreparedTranscription(ids, clip, info, self.suppress, self.begin_suppress, words=words)
        rules = TimestampRules(self.timestamp_begin, self.eos, self.no_timestamps, self.max_initial_timestamp)
        timestamps = TimestampTokens(self.timestamp_begin, prompt.timestamps, prompt.offset_seconds,
                                     info.duration_seconds)  # fmt: skip
        return PreparedTranscription(ids, clip, info, self.suppress, self.begin_suppress,
                                     rules if prompt.timestamps else None, timestamps, words)  # fmt: skip

    def windows(self, prompt: TranscriptionPrompt) -> tuple[list[TranscriptionPrompt], float] | None:
        """None where `prompt`'s clip fits the encoder's window (`max_seconds`: it runs as it is, `prepare`), or is no
        audio (refused by `prepare`); else its windows (`clip_windows.split_clip` on the clip decoded once at the
        model's rate, each a float32 WAV of its own: its own digest) as transcriptions of their own with `prompt`'s
        language, task, previous text and timestamps, each with its start in the clip (`offset_seconds`), and the whole
        clip's seconds. ValidationError for a clip longer than
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
        return [dataclasses.replace(prompt, audio=window_wav(samples[start:end], self.sampling_rate),
                                    offset_seconds=prompt.offset_seconds + start / self.sampling_rate)
                for start, end in cuts], seconds  # fmt: skip

    def silence_probe(self, prompt: TranscriptionPrompt, vocab_size: int) -> PreparedTranscription | None:
        """The one-token request that measures how silent `prompt`'s clip is, as Whisper does: its previous text and
        `<|startoftranscript|>`, every token of the model's `vocab_size` but `<|nospeech|>` suppressed (its output's
        raw log-probability is the one Whisper reads after that token); None where the vocabulary has no such token.
        Its encoder states are kept for the transcription beside it."""
        if self.no_speech is None:
            return None
        clip, info = self._clip(prompt.audio, "", detection=True)
        return PreparedTranscription([*self._previous_text(prompt.prompt), self.start], clip, info,
                                     self._all_but(self.no_speech, vocab_size), ())  # fmt: skip

    @functools.cache  # noqa: B019  (one entry a model: its vocabulary size; the instance lives as long as the engine)
    def _all_but(self, token: int, vocab_size: int) -> tuple[int, ...]:
        """Every token id below `vocab_size` but `token` (a silence probe's suppressed tokens), made once."""
        return tuple(t for t in range(vocab_size) if t != token)

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

    def _clip(
        self, data: bytes, language: str, detection: bool = False, words: bool = False
    ) -> tuple[MultimodalInputs, TranscriptionInfo]:
        """The clip as the encoder takes it (a language `detection`'s: its states kept for the transcription after
        it; asking `words`: its attention kept over its encoder frames, half its feature frames, as transformers
        crops it) and what the caller learns of it; ValidationError as `prepare`."""
        samples, seconds = decoded_clip(PromptAudio(data, "input.transcription.audio"), self.sampling_rate,
                                        self.max_seconds)  # fmt: skip
        found = self.extractor(samples, sampling_rate=self.sampling_rate, return_tensors="pt",
                               return_attention_mask=True)  # fmt: skip
        span = ImageSpan(0, 0, found.input_features, image_digest(data))
        frames = int(found.attention_mask.sum()) // 2 if words else 0
        clip = MultimodalInputs((span,), transcription=True, detects_language=detection, align_frames=frames)
        return clip, TranscriptionInfo(language, seconds)


def _token_id(tokenizer: Any, name: str) -> int | None:
    """The id of the token spelled `name` in `tokenizer`'s vocabulary; None where it has none (not its unknown's)."""
    found = tokenizer.convert_tokens_to_ids(name)
    return int(found) if found is not None and tokenizer.convert_ids_to_tokens(int(found)) == name else None


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
