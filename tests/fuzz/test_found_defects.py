"""Every request schema fuzzing found answered 5xx, replayed through the real gateway and engine: each is now a
400 in OpenAI's shape naming the field where it can, and the engine keeps serving. The bodies are sent as raw
JSON text, as a client would (a "\\ud800" escape is how a lone surrogate arrives)."""

from __future__ import annotations

import json

import httpx
import pytest

from benchmarks.fuzz_cases import error_shape_problem
from tests.e2e.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow

HELLO = '[{"role": "user", "content": "Hi"}]'
# (route, body text without "model", the param the error must name: None where no one field is to blame)
DEFECTS = [
    ("/v1/chat/completions", f'"messages": {HELLO}, "stop_token_ids": [7, -8355951742927]', "stop_token_ids[1]"),
    ("/v1/chat/completions", f'"messages": {HELLO}, "stop_token_ids": [42203322412373032960]', "stop_token_ids[0]"),
    ("/v1/completions", '"prompt": "Hi", "max_tokens": 4294967296', "max_tokens"),
    ("/v1/chat/completions", f'"messages": {HELLO}, "max_completion_tokens": 4294967296', "max_completion_tokens"),
    ("/v1/completions", '"prompt": "Hi", "top_k": 2147483648', "top_k"),
    ("/v1/completions", '"prompt": "Hi", "min_tokens": 4294967296', "min_tokens"),
    ("/v1/completions", '"prompt": "Hi", "logit_bias": {"--5": 1}', "logit_bias"),
    ("/v1/completions", '"prompt": "Hi", "logit_bias": {"\\u00b2": 1}', "logit_bias"),
    ("/v1/completions", '"prompt": [4294967296]', "prompt"),
    ("/v1/completions", '"prompt": "\\ud800"', None),
    ("/v1/completions", '"prompt": "Hi", "stop": ["\\udfff"]', None),
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": "\\ud800"}]', None),
    ("/v1/chat/completions/batch", '"messages": [[{"role": "user", "content": "\\ud800"}]]', None),
    # Only the engine sees this one: the tool's parameters travel as JSON text and reach the template parsed.
    ("/v1/chat/completions", f'"messages": {HELLO}, "tools": [{{"type": "function", "function": '
     '{"name": "f", "parameters": {"type": "object", "description": "\\ud800"}}}]', "messages"),
]


@pytest.mark.parametrize(("route", "fields", "param"), DEFECTS)
def test_a_request_fuzzing_found_is_a_400(
    fuzz_gateway: GatewayProcess, model_id: str, route: str, fields: str, param: str | None
) -> None:
    cap = "" if '"max_tokens"' in fields else '"max_tokens": 2, '  # should a fix regress, generate little
    body = f'{{"model": {json.dumps(model_id)}, {cap}{fields}}}'
    response = httpx.post(fuzz_gateway.url + route, content=body.encode(),
                          headers={"content-type": "application/json"}, timeout=120)
    assert response.status_code == 400, response.text
    assert error_shape_problem(400, response.headers["content-type"], response.content) is None
    assert response.json()["error"]["param"] == param, response.text
