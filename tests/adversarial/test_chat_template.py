"""A model whose chat template tries to escape the Jinja sandbox.

An engine takes its chat template from the model folder (`chat_template.jinja`, or `chat_template` in
tokenizer_config.json) and never from a request. Here the embedded model's folder is copied (weights linked) with
a template that reaches for Python internals, runs a shell command or mutates its input when the first message
asks it to: none of it runs, the request fails with FAILED_PRECONDITION (HTTP 500: the model, not the caller, is
at fault), and the engine goes on serving chat that stays inside the sandbox, text prompts and other callers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from engine_server.loader import resolve_model, write_float_checkpoint
from ladle.v1 import engine_pb2, engine_pb2_grpc
from tests.adversarial.helpers import assert_rpc_error, rpc_error, still_serves_grpc
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, start_gateway
from tests.e2e.helpers import assert_error, chat_input, sampling

pytestmark = pytest.mark.slow

# What the template does when the first message's content names it; anything else renders a normal prompt.
ESCAPES = {
    "read-python-internals": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "run-a-command": "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "import-through-lipsum": "{{ lipsum.__globals__['os'].system('touch MARKER') }}",
    "mutate-the-input": "{% set _ = messages.append({'role': 'system', 'content': 'owned'}) %}{{ messages }}",
}
NORMAL = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def hostile_template(marker: Path) -> str:
    branches = "".join(
        f"{{% {'if' if i == 0 else 'elif'} messages[0]['content'] == '{name}' %}}{body.replace('MARKER', str(marker))}"
        for i, (name, body) in enumerate(ESCAPES.items())
    )
    return branches + "{% else %}" + NORMAL + "{% endif %}"


@dataclass
class HostileModel:
    engine: EngineProcess
    gateway: GatewayProcess
    marker: Path
    model_id: str


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileModel]:
    folder = write_float_checkpoint(resolve_model("default"), tmp_path_factory.mktemp("hostile-model"))
    marker = folder / "escaped"
    (folder / "chat_template.jinja").write_text(hostile_template(marker))
    engine = start_engine(folder / "engine.log", "--model", str(folder), "--max-num-seqs", "4")
    gateway = start_gateway(folder / "gateway.log", engine.address)
    try:
        yield HostileModel(engine, gateway, marker, folder.name)
    finally:
        assert gateway.stop() == 0
        assert engine.stop() == 0


def test_a_chat_template_that_tries_to_escape_the_sandbox(hostile: HostileModel) -> None:
    with grpc.insecure_channel(hostile.engine.address) as channel, \
            httpx.Client(base_url=hostile.gateway.url, timeout=120) as http:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        for probe in ESCAPES:
            error = rpc_error(stub.Generate, engine_pb2.GenerateRequest(input=chat_input(probe), sampling=sampling(2)),
                              timeout=60)
            assert_rpc_error(error, grpc.StatusCode.FAILED_PRECONDITION, None,
                             "the model's chat template attempted an operation its sandbox forbids (")
            assert "is unsafe" in (error.details() or "")
            tokenize = rpc_error(stub.Tokenize, engine_pb2.TokenizeRequest(input=chat_input(probe)), timeout=60)
            assert tokenize.code() is grpc.StatusCode.FAILED_PRECONDITION

            body = {"model": hostile.model_id, "messages": [{"role": "user", "content": probe}], "max_tokens": 2}
            failed = assert_error(http.post("/v1/chat/completions", json=body), 500, None, "internal_error")
            assert failed["type"] == "server_error"
            assert failed["message"].startswith(
                "the engine failed: the model's chat template attempted an operation its sandbox forbids (")
        assert not hostile.marker.exists(), "a command ran from inside the chat template"
        assert "owned" not in stub.Tokenize(engine_pb2.TokenizeRequest(input=chat_input("Hi")), timeout=60).prompt_text

        # Chat that stays inside the sandbox, text prompts and plain calls are served as before.
        fine = http.post("/v1/chat/completions", json={"model": hostile.model_id, "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "Hello"}]})
        assert fine.status_code == 200, fine.text
        completion = http.post("/v1/completions", json={"model": hostile.model_id, "prompt": "Hi", "max_tokens": 2})
        assert completion.status_code == 200, completion.text
        still_serves_grpc(stub)
    assert "the engine cannot serve it as configured" in hostile.engine.log()
