"""SamplingParams.validate and validate_token_ids: every refusal names its parameter; edges are accepted."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from engine_server.errors import ValidationError
from engine_server.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    SamplingParams,
    validate_token_ids,
)

VOCAB = 5000  # above MAX_LOGIT_BIAS_ENTRIES, so a full logit_bias fits
MAX_LEN = 2048
NAN, INF = float("nan"), float("inf")


def check(prompt_len: int = 10, **fields: Any) -> None:
    SamplingParams(**fields).validate(vocab_size=VOCAB, max_model_len=MAX_LEN, prompt_len=prompt_len)


BAD: list[tuple[dict[str, Any], str]] = [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.01}, "temperature"),
    ({"temperature": NAN}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": NAN}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": NAN}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -INF}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": NAN}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": INF}, "repetition_penalty"),
    ({"repetition_penalty": NAN}, "repetition_penalty"),
    ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"logit_bias": {5: -101.0}}, "logit_bias"),
    ({"logit_bias": {5: NAN}}, "logit_bias"),
    ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}}, "logit_bias"),
    ({"n": 0}, "n"),
    ({"n": MAX_N + 1}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 11, "max_tokens": 10}, "min_tokens"),
    ({"stop": ("",)}, "stop"),
    ({"stop": ("x" * (MAX_STOP_STRING_LEN + 1),)}, "stop"),
    ({"stop": tuple(str(i) for i in range(MAX_STOP_STRINGS + 1))}, "stop"),
    ({"stop_token_ids": (VOCAB,)}, "stop_token_ids"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ({"top_logprobs": MAX_TOP_LOGPROBS + 1, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),  # requires logprobs
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_out_of_range_values_are_refused_with_their_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as info:
        check(**fields)
    assert info.value.param == param
    assert info.value.message


GOOD: list[dict[str, Any]] = [
    {},
    {"temperature": 0.0},
    {"temperature": 2.0},
    {"top_p": 1e-9},
    {"top_p": 1.0},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": VOCAB * 10},  # larger than the vocabulary: same as disabled
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"repetition_penalty": 1e-3},
    {"repetition_penalty": 5.0},
    {"logit_bias": {0: -100.0, VOCAB - 1: 100, 7: np.float32(3.5)}},
    {"logit_bias": {i: 0.0 for i in range(MAX_LOGIT_BIAS_ENTRIES)}},
    {"n": MAX_N},
    {"max_tokens": 1},
    {"min_tokens": 10, "max_tokens": 10},
    {"min_tokens": 50},  # max_tokens None: bounded by the context later
    {"stop": tuple("abcdefghijklmnop"[:MAX_STOP_STRINGS])},
    {"stop": ("x" * MAX_STOP_STRING_LEN,)},
    {"stop_token_ids": (0, VOCAB - 1)},
    {"logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS},
    {"logprobs": True},
    {"seed": 0},
    {"seed": 2**63 - 1},
]


@pytest.mark.parametrize("fields", GOOD)
def test_edge_values_are_accepted(fields: dict[str, Any]) -> None:
    check(**fields)


def test_empty_prompt_is_refused() -> None:
    with pytest.raises(ValidationError, match="empty prompt") as info:
        check(prompt_len=0)
    assert info.value.param == "prompt"


def test_prompt_plus_max_tokens_must_fit_the_context() -> None:
    check(prompt_len=MAX_LEN - 100, max_tokens=100)
    with pytest.raises(ValidationError) as info:
        check(prompt_len=MAX_LEN - 100, max_tokens=101)
    assert info.value.param == "max_tokens"
    assert str(MAX_LEN - 100) in info.value.message and "101" in info.value.message
    assert str(MAX_LEN) in info.value.message


def test_prompt_filling_the_context_leaves_no_room_for_a_token() -> None:
    check(prompt_len=MAX_LEN - 1)
    with pytest.raises(ValidationError) as info:
        check(prompt_len=MAX_LEN)
    assert info.value.param == "prompt"
    assert str(MAX_LEN) in info.value.message


def test_validate_does_not_change_the_params() -> None:
    params = SamplingParams(temperature=0.5, logit_bias={1: 2.0})
    before = dataclasses.replace(params)
    params.validate(vocab_size=VOCAB, max_model_len=MAX_LEN, prompt_len=3)
    assert params == before


def test_tiny_temperature_counts_as_greedy() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-7).greedy
    assert not SamplingParams(temperature=0.01).greedy


@pytest.mark.parametrize("ids", [[], [0], [0, VOCAB - 1, 5], range(VOCAB), (3, 4), np.arange(5)])
def test_validate_token_ids_accepts_ids_in_the_vocabulary(ids: Any) -> None:
    validate_token_ids(ids if not isinstance(ids, np.ndarray) else list(ids), VOCAB)


@pytest.mark.parametrize(
    ("ids", "bad"),
    [([0, VOCAB], VOCAB), ([-1, 3], -1), ([1, 2.5], 2.5), ([True, 1], True), ([1, "2"], "2")],
)
def test_validate_token_ids_names_the_offending_id(ids: list[Any], bad: Any) -> None:
    with pytest.raises(ValidationError) as info:
        validate_token_ids(ids, VOCAB, param="messages")
    assert info.value.param == "messages"
    assert repr(bad) in info.value.message
