"""SGLang's `/generate` bodies into engine requests and the engine's choices back (`gateway.translate.sglang`)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.errors import APIError
from gateway.schemas.sglang import SGLangGenerateRequest
from gateway.translate import sglang
from ladle.v1 import types_pb2


def calls(**fields: Any) -> list[sglang.PromptCall]:
    return sglang.prompt_calls(SGLangGenerateRequest.model_validate(fields), "call")


def test_sampling_params_mean_what_sglang_means() -> None:
    (call,) = calls(text="Hi", sampling_params={
        "max_new_tokens": 7, "min_new_tokens": 2, "temperature": 0.5, "top_k": -1, "stop": "x", "no_stop_trim": True,
        "stop_token_ids": [5], "sampling_seed": 9, "n": 2, "json_schema": '{"type": "object"}',
        "logit_bias": {"3": 1.5}}, return_logprob=True, top_logprobs_num=3, logprob_start_len=1)  # fmt: skip
    request = sglang.engine_request(call, "r-0")
    s = request.sampling
    assert (s.max_tokens, s.min_tokens, s.temperature, s.top_k, list(s.stop), s.include_stop_str_in_output) == (
        7, 2, 0.5, -1, ["x"], True)
    assert (list(s.stop_token_ids), s.seed, s.n, dict(s.logit_bias)) == ([5], 9, 2, {3: 1.5})
    assert (s.logprobs, s.top_logprobs, s.prompt_logprobs) == (True, 3, 3)
    assert json.loads(request.constraint.json_schema) == {"type": "object"}
    assert request.input.text == "Hi" and call.rid == "call"
    (default,) = calls(input_ids=[1, 2])
    plain = sglang.engine_request(default, "r").sampling
    assert plain.max_tokens == 128 and not plain.HasField("temperature") and not plain.HasField("prompt_logprobs")


def test_batches_take_one_value_or_one_each() -> None:
    batch = calls(text=["a", "b"], sampling_params=[{"max_new_tokens": 1}, {"max_new_tokens": 2}], rid="q",
                  lora_path=["x", None])  # fmt: skip
    assert [c.sampling.max_new_tokens for c in batch] == [1, 2] and [c.rid for c in batch] == ["q-0", "q-1"]
    assert [c.adapter for c in batch] == ["x", None]
    with pytest.raises(APIError) as refused:
        calls(text="a", sampling_params=[{}])
    assert refused.value.param == "sampling_params"


def test_finish_reasons_and_outputs_are_sglangs() -> None:
    stop = types_pb2.MatchedStop(token_id=2)
    assert sglang.finish_reason(types_pb2.FINISH_REASON_STOP, stop, 4) == {"type": "stop", "matched": 2}
    text = types_pb2.MatchedStop(text="\n")
    assert sglang.finish_reason(types_pb2.FINISH_REASON_STOP, text, 4) == {"type": "stop", "matched": "\n"}
    assert sglang.finish_reason(types_pb2.FINISH_REASON_LENGTH, None, 4) == {"type": "length", "length": 4}
    assert sglang.finish_reason(types_pb2.FINISH_REASON_UNSPECIFIED, None, 4) is None
    choice = types_pb2.Choice(text=" Paris", token_ids=[7, 8], finish_reason=types_pb2.FINISH_REASON_LENGTH,
                              logprobs=[types_pb2.TokenLogprob(token_id=7, token=" Par", logprob=-0.5),
                                        types_pb2.TokenLogprob(token_id=8, token="is", logprob=-0.25)])  # fmt: skip
    (call,) = calls(text="Hi", return_logprob=True)
    out = sglang.output(call, sglang.whole_choice(choice), types_pb2.Usage(prompt_tokens=3), 0.5, None)
    assert out == {"text": " Paris", "output_ids": [7, 8], "meta_info": {
        "id": "call", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "completion_tokens": 2,
        "cached_tokens": 0, "e2e_latency": 0.5, "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]],
        "output_top_logprobs": [None, None]}}  # fmt: skip
