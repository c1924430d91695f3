"""Pooling calls in the engine's vocabulary: what an Embed or Score call asks, what it returns, and the core
requests (one per input, prefill only) that compute it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_server.core.request import Priority, Request
from engine_server.errors import ValidationError
from engine_server.frontend import InputProcessor, Prompt, core_request_id
from engine_server.pooling.params import PoolingParams
from engine_server.sampling_params import SamplingParams

MAX_INPUTS = 2048  # per call, as OpenAI's embeddings endpoint; a Batch call streams any number of calls
_NO_SAMPLING = SamplingParams()  # a pooling request samples nothing; its Request still carries parameters


@dataclass(frozen=True)
class EmbedInput:
    """One Embed call: `prompts` to embed in order; `normalize` and `dimensions` None take the model's defaults;
    `truncate_prompt_tokens` keeps each input's last k tokens (None: a too-long input is refused)."""

    request_id: str
    prompts: Sequence[Prompt]
    normalize: bool | None = None
    dimensions: int | None = None
    priority: Priority = Priority.INTERACTIVE
    truncate_prompt_tokens: int | None = None
    cache_salt: str = ""  # the inputs' prefix-cache namespace (core `Request`)


@dataclass(frozen=True)
class ScoreInput:
    """One Score call: each document scored against `query`."""

    request_id: str
    query: Prompt
    documents: Sequence[Prompt]
    priority: Priority = Priority.INTERACTIVE
    truncate_prompt_tokens: int | None = None
    cache_salt: str = ""


@dataclass(frozen=True)
class EmbedResult:
    """The vectors of an Embed call's inputs, in order (1-D float32 tensors), and each input's token count."""

    request_id: str
    vectors: list[torch.Tensor]
    num_tokens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(self.num_tokens)


@dataclass(frozen=True)
class ScoreResult:
    """One score per document, in order, and the tokens of the query and every document."""

    request_id: str
    scores: list[float]
    prompt_tokens: int


def pooling_token_ids(inputs: InputProcessor, prompt: Prompt, truncate: int | None, param: str) -> list[int]:
    """The token ids an input is pooled over (blocking: run it off the event loop): text with the tokenizer's
    special tokens, chat rendered with the model's template, token ids as given; the last `truncate` of them when
    it is set. ValidationError (naming `param`) for an empty input or one longer than the context."""
    if isinstance(prompt, str | Sequence) and len(prompt) == 0:  # (a chat or a transcription: tokenize refuses it)
        raise ValidationError(f"{param} must not be empty", param)
    try:
        ids = inputs.tokenize(prompt)
    except ValidationError as error:
        raise ValidationError(error.message, param) from None
    if truncate and len(ids) > truncate:
        ids = ids[-truncate:]
    if len(ids) > inputs.max_model_len:
        raise ValidationError(
            f"{param} has {len(ids)} tokens, more than the context length ({inputs.max_model_len}); "
            "shorten it or set truncate_prompt_tokens",
            param,
        )
    return ids


def pair_token_ids(inputs: InputProcessor, query: Prompt, document: Prompt, truncate: int | None) -> list[int]:
    """A cross-encoder's input for one (query, document) pair, as its tokenizer encodes a text pair (`[CLS] query
    [SEP] document [SEP]` for BERT), the document cut to fit `truncate` tokens when set (blocking: run it off the
    event loop). ValidationError for non-text or empty parts, or a pair longer than the context."""
    for part, param in ((query, "query"), (document, "documents")):
        if not isinstance(part, str):
            raise ValidationError("a cross-encoder scores text pairs: the query and documents must be text", param)
        if not part:
            raise ValidationError(f"{param} must not be empty", param)
    assert isinstance(query, str) and isinstance(document, str)
    limit = min(truncate, inputs.max_model_len) if truncate else None
    encoded = inputs.tokenizer(query, document, truncation="only_second" if limit else False, max_length=limit)
    ids = list(encoded["input_ids"])
    if len(ids) > inputs.max_model_len:
        raise ValidationError(
            f"a query and document pair has {len(ids)} tokens, more than the context length "
            f"({inputs.max_model_len}); shorten it or set truncate_prompt_tokens",
            "documents",
        )
    return ids


def check_num_inputs(count: int, param: str) -> None:
    """ValidationError unless 1 <= count <= MAX_INPUTS."""
    if not 1 <= count <= MAX_INPUTS:
        raise ValidationError(f"{param} must hold between 1 and {MAX_INPUTS} inputs, got {count}", param)


def pooling_requests(
    request_id: str,
    token_ids: Sequence[list[int]],
    params: PoolingParams,
    max_model_len: int,
    priority: Priority,
    deadline: float | None = None,
    cache_salt: str = "",
) -> list[Request]:
    """One prefill-only core request per input, with ids `{request_id}/{i}` (as choices of a generation), in the
    prefix-cache namespace `cache_salt`."""
    return [
        Request(
            core_request_id(request_id, i),
            ids,
            _NO_SAMPLING,
            max_model_len=max_model_len,
            priority=priority,
            deadline=deadline,
            pooling=params,
            cache_salt=cache_salt,
        )
        for i, ids in enumerate(token_ids)
    ]


def cosine_scores(query: torch.Tensor, documents: Sequence[torch.Tensor]) -> list[float]:
    """The cosine similarity of each document's vector with the query's."""
    stacked = F.normalize(torch.stack(list(documents)).float(), dim=1)
    return (stacked @ F.normalize(query.float(), dim=0)).tolist()
