"""SGLang's native `POST /generate` body (its `GenerateReqInput`, the fields ladle serves): `text` or `input_ids`,
one prompt or a batch, with `sampling_params` (SGLang's `SamplingParams`: one for every prompt, or one each). Its
sampling keys are checked as SGLang's constructor checks them: an unknown one is a 400. Request fields SGLang has and
ladle does not serve (embeddings or media as input, custom logit processors, hidden states, sessions) are refused by
name (`translate.sglang`), never ignored. Types are checked strictly (no string or boolean read as a number), as
the schema states them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.schemas.common import STRICT_IGNORE_EXTRA, TokenId

SGLANG_MAX_NEW_TOKENS = 128  # SGLang's default max_new_tokens


class SGLangSampling(BaseModel):
    """One prompt's `sampling_params`; unset fields take the model's generation defaults, as SGLang's
    `--sampling-defaults model` (its default) takes them, and max_new_tokens SGLang's 128."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    max_new_tokens: int | None = Field(default=SGLANG_MAX_NEW_TOKENS, ge=0, le=2**32 - 1)
    min_new_tokens: int = Field(default=0, ge=0, le=2**32 - 1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # (a detokenizer hint; ignored)
    no_stop_trim: bool = False
    n: int = Field(default=1, ge=1, le=16)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    # SGLang's, not served: refused when set (`translate.sglang.UNSERVED_SAMPLING`).
    structural_tag: str | None = None
    custom_params: Any = None


class SGLangGenerateRequest(BaseModel):
    """The body of SGLang's `/generate`. Exactly one of `text` and `input_ids`; a list of prompts (or of id lists)
    is a batch, answered as a list."""

    model_config = STRICT_IGNORE_EXTRA
    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: str | list[str | None] | None = None
    # SGLang's, not served: refused when set (`translate.sglang.UNSERVED_REQUEST`).
    input_embeds: Any = None
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    custom_logit_processor: Any = None
    return_hidden_states: Any = False
    session_params: Any = None
    token_ids_logprob: Any = None
