"""Per-request sampling parameters as the engine core sees them, with their validation."""

from __future__ import annotations

from dataclasses import dataclass, field

# Documented caps; requests above them are refused with a ValidationError.
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. Defaults are the OpenAI semantic defaults.

    temperature 0 means greedy. top_k <= 0 disables top-k. max_tokens None means "up to the context".
    logprobs True returns the sampled token's log-probability; top_logprobs (0..20) adds the k best.
    """

    n: int = 1
    max_tokens: int | None = None
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
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
