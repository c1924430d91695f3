"""`/v1/audio/transcriptions` and `/v1/audio/translations` form fields (OpenAI's, with vLLM's sampling extras):
what the gateway accepts, with OpenAI's ranges and defaults.

The form's text fields arrive as strings and are converted by pydantic as a JSON body's would be ("0.2" a float,
"true" a boolean). Unknown fields are ignored, as on the JSON routes (the SDK sends options of other models);
`include[]` and `timestamp_granularities[]` are lists, every other field is given once. What the engine cannot
give is refused by `translate.transcriptions.check_form`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from gateway.schemas.common import IGNORE_EXTRA, INT32_MAX, INT64_MAX, INT64_MIN, UINT32_MAX

AudioResponseFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]
Task = Literal["transcribe", "translate"]
LIST_FIELDS = frozenset({"include", "timestamp_granularities"})
STREAMED_FORMATS = frozenset({"json", "text"})


class TranscriptionForm(BaseModel):
    """The fields of a transcription or translation form (the clip itself is the `file` part, read apart).

    `language` is the speech's (ISO-639-1 or a name the model knows; unset: detected); on a translation it is
    vLLM's extra, the language translated from. `to_language` (vLLM's) may only be English: Whisper translates
    into English alone. `temperature` unset is 0 (greedy), as OpenAI's whisper-1 decodes first, and then hotter
    where the decode fails Whisper's checks (its temperature fallback); `temperature_fallback` (ladle's extra) false
    decodes once.
    """

    model_config = IGNORE_EXTRA

    model: str | None = None
    language: str | None = None
    to_language: str | None = None
    prompt: str = ""
    response_format: AudioResponseFormat = "json"
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    timestamp_granularities: list[Literal["word", "segment"]] = Field(default_factory=list)
    include: list[str] = Field(default_factory=list)
    stream: bool = False
    # vLLM's sampling extras.
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    # ladle's extra: false decodes a window once, greedily at temperature 0, without Whisper's temperature fallback.
    temperature_fallback: bool = True

    @property
    def shows_words(self) -> bool:
        """Whether verbose_json answers words (`timestamp_granularities` holds `word`)."""
        return "word" in self.timestamp_granularities

    @property
    def shows_segments(self) -> bool:
        """Whether the answer shows segments: `segment` asked, or no granularity (a timed format's default)."""
        return not self.timestamp_granularities or "segment" in self.timestamp_granularities

    @property
    def want_logprobs(self) -> bool:
        return "logprobs" in self.include

