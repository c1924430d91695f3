"""The gateway's bounded route labels (metrics and spans) for the newer routes, ids as placeholders; and which paths
answer without an API key once keys are set (`/version` does, as `/health` does; `/tokenize` does not)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gateway.config import GatewayConfig
from gateway.middleware import route_label

CONVERSATION = "conv_" + "a" * 32


@pytest.mark.parametrize(("path", "label"), [
    ("/v1/conversations", "/v1/conversations"),
    (f"/v1/conversations/{CONVERSATION}", "/v1/conversations/{conversation_id}"),
    (f"/v1/conversations/{CONVERSATION}/items", "/v1/conversations/{conversation_id}/items"),
    (f"/v1/conversations/{CONVERSATION}/items/msg_1", "/v1/conversations/{conversation_id}/items/{item_id}"),
    ("/v1/responses/input_tokens", "/v1/responses/input_tokens"),
    ("/tokenize", "/tokenize"), ("/detokenize", "/detokenize"), ("/version", "/version"),
    ("/v1/whatever", "other"),
])
def test_route_labels(path: str, label: str) -> None:
    assert route_label(path) == label


async def test_version_answers_without_a_key_and_tokenize_does_not(tmp_path: Path) -> None:
    from gateway.app import create_app

    app = create_app(GatewayConfig(engines=("127.0.0.1:1",), api_key="sk-test", data_dir=tmp_path, batch_workers=0))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
        version = await http.get("/version")
        assert version.status_code == 200 and version.json()["version"]
        refused = await http.post("/tokenize", json={"prompt": "hi"})
        assert refused.status_code == 401
