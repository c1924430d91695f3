"""Request fields shared by chat and completions: sampling (OpenAI's and the vLLM/SGLang extras), stop
sequences, streaming options and structured-output specs.

Ranges here are OpenAI's documented ones, so a bad value is a 400 naming the field before any engine call; the
engine checks again against the model (vocabulary, context length). Where OpenAI sets no upper bound, the
proto field's width does (UINT32_MAX, INT32_MAX): a value the engine's request cannot carry is a 400 too.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Unknown fields are ignored, as OpenAI's SDK sends newer options (store, metadata, service_tier...) that have no
# effect on generation here. Python's JSON parser reads the non-standard NaN / Infinity literals; a number field
# refuses them as "not a finite number" rather than with a misleading range error.
IGNORE_EXTRA = ConfigDict(extra="ignore", allow_inf_nan=False)
# OpenAI's own newer APIs (Responses, Conversations) type-check as OpenAI does: no value is converted to a field's
# type (a boolean or a string is no number, 2.0 no integer); a JSON integer is still a number.
STRICT_IGNORE_EXTRA = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

UINT32_MAX = 2**32 - 1  # token ids and token counts are uint32 in ladle.v1
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # OpenAI's seed
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")  # ASCII digits only: int() also reads "٣" and refuses "²"


class StreamOptions(BaseModel):
    model_config = IGNORE_EXTRA
    include_usage: bool = False


class JsonSchemaSpec(BaseModel):
    """`response_format.json_schema`: a named schema; `strict` is always honoured (the output is constrained)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI `response_format`."""

    model_config = IGNORE_EXTRA
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of these."""

    model_config = IGNORE_EXTRA
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(BaseModel):
    """Fields common to /v1/chat/completions and /v1/completions."""

    model_config = IGNORE_EXTRA

    model: str
    n: int = Field(default=1, ge=1, le=128)
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM / SGLang extras.
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0, le=UINT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: each prompt token's log-probability and the k best alternatives, in vLLM's layout.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM's: the prompt's token ids and each choice's generated ones beside the text (`prompt_token_ids`,
    # `token_ids`; streamed, the prompt's on the first chunk and each chunk's new ones).
    return_token_ids: bool | None = None
    # vLLM's: each logprobs entry's token (and its alternatives') as "token_id:<id>", for tokens whose text is not
    # JSON-safe (part of a character); offsets into the text stay those of the tokens' own text.
    return_tokens_as_token_ids: bool | None = None
    # Structured outputs: OpenAI, vLLM (current and the older guided_* names) and SGLang spellings.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: dict[str, Any] | str | None = None
    # vLLM's beam search: n beams (best_of, on /v1/completions, where given), the n best answered
    # (engine SamplingParams.beam_width); length_penalty and early_stopping as transformers' and vLLM's.
    use_beam_search: bool = False
    # vLLM's extras that would change the answer and are not served: refused when set (`to_engine.sampling`), never
    # ignored. (vLLM's request_id, priority and spaces_between_special_tokens are hints, and are ignored.)
    logits_processors: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    # SGLang's extras: no_stop_trim keeps the matched stop string (include_stop_str_in_output); lora_path names the
    # adapter (as `model` may); those that would change the answer and are not served are refused when set to other
    # than null or their default.
    no_stop_trim: bool = False
    lora_path: str | None = None
    stop_regex: Any = None
    custom_logit_processor: Any = None
    custom_params: Any = None
    return_hidden_states: Any = False
    # vLLM's: words never generated.
    bad_words: list[str] | None = None
    # vLLM's: only these tokens are sampled.
    allowed_token_ids: list[TokenId] | None = None
    # vLLM's: keep the prompt's last k tokens (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    length_penalty: float | None = Field(default=None, allow_inf_nan=False)
    early_stopping: bool = False
    # vLLM's prefix-cache salt: requests share cached prompt blocks only with requests of the same project that
    # send the same salt (gateway.translate.cache_salt); unset, with every request of the project.
    cache_salt: str | None = Field(default=None, min_length=1)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not _TOKEN_ID_KEY.fullmatch(key) or int(key) > UINT32_MAX:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and any(not s for s in value):
            raise ValueError("stop sequences must not be empty")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)
