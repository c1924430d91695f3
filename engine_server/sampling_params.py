"""Per-request sampling parameters as the engine core sees them, with their validation."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine_server.errors import ValidationError
from engine_server.structured.constraint import Constraint

# Documented caps; requests above them are refused with a ValidationError.
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_TOP_LOGPROBS = 20
MAX_BEAM_WIDTH = 16
MAX_BEAM_CANDIDATES = 512  # a beam search step's top log-probabilities: (1 + its stop tokens, at least 2) x beam_width
MAX_LOGIT_BIAS_ENTRIES = 1024
# OpenAI's documented range is [0, 2]; above 2 the distribution is close to uniform noise anyway.
MAX_TEMPERATURE = 2.0
# Temperatures below this are greedy: dividing logits by a denormal would overflow float32 to inf.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_PENALTY = 2.0  # presence / frequency, OpenAI's range [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range [-100, 100]
SEED_LIMIT = 2**63  # seeds live in [0, 2**63): what torch.Generator.manual_seed accepts as int64


@dataclass(frozen=True)
class TimestampRules:
    """Whisper's timestamp rules (`Transcription.timestamps`), as transformers' `WhisperTimeStampLogitsProcessor`
    holds a decode to them; set by the engine, not a caller. Ids from `begin` up are timestamps (`<|0.00|>` and on);
    `no_timestamps` is never sampled; the first output is a timestamp, at most `max_initial` past `begin` (None: any);
    timestamps come in pairs (an opening one is followed by text, a closing one by a timestamp or the end, which is any
    id from `eos` to `begin`) and never go back; and where the timestamps together are likelier than the likeliest
    other token, a timestamp is sampled."""

    begin: int
    eos: int
    no_timestamps: int
    max_initial: int | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. Defaults are the OpenAI semantic defaults.

    temperature 0 (below GREEDY_TEMPERATURE_EPS) means greedy. top_k <= 0 disables top-k. max_tokens None
    means "up to the context", or up to `default_max_tokens` when that is set (the model's generation default,
    see engine_server.generation_defaults): unlike max_tokens, that cap shrinks to what the context leaves after
    the prompt instead of making the request invalid, and never goes below min_tokens. logprobs True returns the
    sampled token's log-probability; top_logprobs (0..20) adds the k best. prompt_logprobs k (0..20; None: not
    asked) returns each prompt token's log-probability given the tokens before it (from the second token on), with
    the k best alternatives (vLLM's prompt_logprobs; what echo with logprobs needs). `constraint` restricts the
    output to a formal language (structured output); the grammar's end ends the choice with `stop` whatever
    min_tokens and ignore_eos say.
    """

    n: int = 1
    max_tokens: int | None = None
    default_max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # vLLM's allowed_token_ids: only these tokens are ever sampled (None: any).
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's bad_words: words never generated. The engine turns them into `bad_word_token_ids` (`InputProcessor.
    # prepare`): each word's tokens, and again after a space where that is other tokens of the same count; a
    # sequence's last token is held at -inf wherever the output so far ends with the tokens before it.
    bad_words: tuple[str, ...] = ()
    bad_word_token_ids: tuple[tuple[int, ...], ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    constraint: Constraint | None = None
    # Tokens never sampled, and tokens not sampled first (Whisper's generation config's `suppress_tokens` and
    # `begin_suppress_tokens`, as transformers' generate applies them: held at -inf); set by the engine, not a caller.
    suppress_token_ids: tuple[int, ...] = ()
    begin_suppress_token_ids: tuple[int, ...] = ()
    timestamps: TimestampRules | None = None  # a Whisper decode with timestamps (set by the engine)
    # The log-probabilities asked are the processed distribution's (after logit_bias, the bans, the timestamp rules,
    # the penalties and a grammar's mask; before the temperature), as Whisper judges a decode; set by the engine.
    processed_logprobs: bool = False
    # Beam search (`engine_server.beam_search`): `beam_width` > 1 keeps that many beams and answers the n best, as
    # transformers' `generate(num_beams=beam_width, num_return_sequences=n)` does, scored by their summed
    # log-probabilities over their length ** `length_penalty`; `early_stopping` ends it once `beam_width` beams
    # finished.
    beam_width: int = 1
    # OpenAI's best_of (legacy completions): sample this many choices and answer the n whose tokens' mean raw
    # log-probability is highest (None: n). Not with beam search (its beam_width is that).
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool = False
    # vLLM's: keep the prompt's last k tokens (-1: as many as the context holds); None: a longer prompt is refused.
    truncate_prompt_tokens: int | None = None
    # A one-token step of a beam search, set by the engine: its top_logprobs are the beams' candidates (up to
    # MAX_BEAM_CANDIDATES, not MAX_TOP_LOGPROBS).
    beam_step: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def validate(self, *, vocab_size: int, max_model_len: int, prompt_len: int) -> None:
        """Raise ValidationError (with the OpenAI parameter name) on the first out-of-range field.

        Checks only the parameters and lengths; the prompt's token ids go through `validate_token_ids`.
        """
        _check_prompt_length(self.max_tokens, prompt_len, max_model_len)
        self.validate_values()
        self._validate_logit_bias(vocab_size)
        self._validate_stops(vocab_size)
        if self.constraint is not None:
            self.constraint.validate()

    def validate_values(self) -> None:
        """The range checks that need neither the model nor the prompt: the numbers and the counts."""
        self._validate_numbers()
        self._validate_counts()
        self._validate_bad_words()

    def _validate_numbers(self) -> None:
        _check_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValidationError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < -1:
            raise ValidationError(
                f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k}", param="top_k"
            )
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_range("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValidationError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}", param="repetition_penalty"
            )
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ValidationError(f"seed must be in [0, 2**63), got {self.seed}", param="seed")

    def _validate_counts(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise ValidationError(f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValidationError(f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValidationError(
                f"default_max_tokens must be at least 1, got {self.default_max_tokens}", param="default_max_tokens"
            )
        if self.min_tokens < 0:
            raise ValidationError(f"min_tokens must be >= 0, got {self.min_tokens}", param="min_tokens")
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValidationError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}",
                                  param="beam_width")  # fmt: skip
        if self.best_of is not None:
            if not self.n <= self.best_of <= MAX_N:
                raise ValidationError(f"best_of must be in [n, {MAX_N}] (n = {self.n}), got {self.best_of}",
                                      param="best_of")  # fmt: skip
            if self.beam_width > 1:
                raise ValidationError("best_of samples; with beam search set beam_width instead", param="best_of")
        if self.beam_width > 1 and self.n > self.beam_width:
            raise ValidationError(f"beam search answers at most its beam_width ({self.beam_width}) choices, not n = "
                                  f"{self.n}", param="n")  # fmt: skip
        _check_finite("length_penalty", self.length_penalty)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValidationError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        if not 0 <= self.top_logprobs <= (MAX_BEAM_CANDIDATES if self.beam_step else MAX_TOP_LOGPROBS):
            raise ValidationError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
                param="top_logprobs",
            )
        if self.top_logprobs > 0 and not self.logprobs:
            raise ValidationError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValidationError(
                f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}",
                param="prompt_logprobs",
            )

    def _validate_logit_bias(self, vocab_size: int) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValidationError(
                f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed",
                param="logit_bias",
            )
        for token_id, bias in self.logit_bias.items():
            if not _is_int(token_id) or not 0 <= token_id < vocab_size:
                raise ValidationError(
                    f"logit_bias key {token_id!r} is not a token id in [0, {vocab_size})", param="logit_bias"
                )
            _check_range("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)

    def _validate_bad_words(self) -> None:
        if len(self.bad_words) > MAX_STOP_STRINGS:
            raise ValidationError(f"at most {MAX_STOP_STRINGS} bad_words are allowed, got {len(self.bad_words)}",
                                  param="bad_words")  # fmt: skip
        for word in self.bad_words:
            if not word.strip() or len(word) > MAX_STOP_STRING_LEN:
                raise ValidationError(f"bad_words must be words of 1 to {MAX_STOP_STRING_LEN} characters, got "
                                      f"{word!r}", param="bad_words")  # fmt: skip

    def _validate_stops(self, vocab_size: int) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValidationError(
                f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(self.stop)}", param="stop"
            )
        for text in self.stop:
            if not text:
                raise ValidationError("stop sequences must not be empty", param="stop")
            if len(text) > MAX_STOP_STRING_LEN:
                raise ValidationError(
                    f"stop sequences must be at most {MAX_STOP_STRING_LEN} characters, got {len(text)}",
                    param="stop",
                )
        validate_token_ids(self.stop_token_ids, vocab_size, param="stop_token_ids")
        if self.allowed_token_ids is not None:
            if not 0 < len(self.allowed_token_ids) <= vocab_size:
                raise ValidationError(f"allowed_token_ids must name 1 to {vocab_size} tokens (the vocabulary), not "
                                      f"{len(self.allowed_token_ids)}", param="allowed_token_ids")  # fmt: skip
            validate_token_ids(self.allowed_token_ids, vocab_size, param="allowed_token_ids")


def validate_token_ids(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    """Raise ValidationError unless every id is an integer (not a bool) in [0, vocab_size). Empty passes."""
    if not ids:
        return
    # set(map(type)) and min/max run in C: cheap even for a 100k-token prompt.
    ok = all(issubclass(t, numbers.Integral) and t is not bool for t in set(map(type, ids)))
    if ok and min(ids) >= 0 and max(ids) < vocab_size:
        return
    bad = next(i for i in ids if not _is_int(i) or not 0 <= i < vocab_size)
    raise ValidationError(f"token id {bad!r} in {param} is not in [0, {vocab_size})", param=param)


def _check_prompt_length(max_tokens: int | None, prompt_len: int, max_model_len: int) -> None:
    if prompt_len < 1:
        raise ValidationError("empty prompt: at least one prompt token is required", param="prompt")
    wanted = 1 if max_tokens is None else max_tokens
    if prompt_len + wanted > max_model_len:
        what = "1 token" if max_tokens is None else f"max_tokens={max_tokens}"
        raise ValidationError(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{prompt_len} tokens and {what} were requested ({prompt_len + wanted} in all)",
            param="prompt" if max_tokens is None else "max_tokens",
        )


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_finite(param: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValidationError(f"{param} must be a finite number, got {value!r}", param=param)


def _check_range(param: str, value: float, lo: float, hi: float) -> None:
    _check_finite(param, value)
    if not lo <= value <= hi:
        raise ValidationError(f"{param} must be in [{lo:g}, {hi:g}], got {value}", param=param)
