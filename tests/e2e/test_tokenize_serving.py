"""vLLM's `/tokenize`, `/detokenize` and `/version` through a real gateway and engine (the embedded model): a
prompt's tokens are the engine's own, a conversation's count is what a chat request of it is billed, token ids
decode back to the text, and bad bodies are OpenAI-shaped errors naming the field."""

from __future__ import annotations

from importlib import metadata

import httpx
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc
from tests.e2e.helpers import text_input

pytestmark = pytest.mark.slow

TEXT = "Tokenizers split text into pieces."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def test_tokenize_and_detokenize_round_trip(gateway_http: httpx.Client, model_id: str,
                                            stub: engine_pb2_grpc.EngineServiceStub) -> None:
    reply = gateway_http.post("/tokenize", json={"model": model_id, "prompt": TEXT, "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    engine = stub.Tokenize(engine_pb2.TokenizeRequest(input=text_input(TEXT)), timeout=10)
    assert body["tokens"] == list(engine.token_ids) and body["count"] == len(engine.token_ids)
    assert body["token_strs"] == list(engine.tokens) and body["max_model_len"] == 8192
    assert gateway_http.post("/tokenize", json={"prompt": TEXT}).json()["token_strs"] is None  # model optional
    back = gateway_http.post("/detokenize", json={"model": model_id, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}


def test_a_conversations_count_is_what_chat_bills(gateway_http: httpx.Client, model_id: str) -> None:
    counted = gateway_http.post("/tokenize", json={"model": model_id, "messages": MESSAGES}).json()
    chat = gateway_http.post("/v1/chat/completions", json={"model": model_id, "messages": MESSAGES,
                                                           "max_tokens": 1}).json()
    assert counted["count"] == chat["usage"]["prompt_tokens"] == len(counted["tokens"])
    bare = gateway_http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["count"] < counted["count"]  # without the assistant turn's header


def test_errors_and_version(gateway_http: httpx.Client, model_id: str) -> None:
    both = gateway_http.post("/tokenize", json={"prompt": "x", "messages": MESSAGES})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
    robot = gateway_http.post("/tokenize", json={"messages": [{"role": "robot", "content": "x"}]})
    assert robot.status_code == 400 and robot.json()["error"]["param"].startswith("messages[0]")
    unknown = gateway_http.post("/tokenize", json={"model": "gpt-4o", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    outside = gateway_http.post("/detokenize", json={"tokens": [1, 10_000_000]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    assert httpx.get(str(gateway_http.base_url) + "/version").json() == {"version": metadata.version("ladle")}
