"""A multimodal checkpoint served as its text model end to end: a LLaVA checkpoint as transformers saves it, its chat
template where LLaVA's releases keep it (the processor's `chat_template.json`, read as a list of parts alone), behind
`ladle engine --model FOLDER --quantization none` and `ladle gateway`, through the official openai SDK: the prompt is
what the template renders for OpenAI's text parts, the reply transformers' greedy tokens for it, whether the caller
sends a string or text parts; an image is refused by name (the checkpoint holds no image processor). A Qwen2.5-VL
checkpoint that reads images, behind the same two processes: images sent as data: URLs and as http URLs the gateway
fetches, through the SDK (whole and streamed) and through the engine's own gRPC API, answered with transformers'
greedy tokens for the prompt its processor lays out. A Qwen2-Audio checkpoint on two tensor-parallel ranks: OpenAI's
`input_audio` parts (WAV and MP3) through the SDK, answered likewise."""

from __future__ import annotations

import base64
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from ladle.client import EngineClient
from ladle.v1 import engine_pb2, types_pb2
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, start_gateway
from tests.unit.test_frontend import PARTS_BY_LOOP
from tests.unit.test_image_input import png, qwen_inputs, save_qwen_vl, transformers_greedy, user
from tests.unit.test_multimodal_text_models import _multimodal, _saved

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, EngineProcess, GatewayProcess]]:
    """A LLaVA checkpoint whose tokenizer has no template, its processor's `chat_template.json` the parts-only one."""
    root = tmp_path_factory.mktemp("llava")
    folder = root / "model"
    _saved(_multimodal("llava"), folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": PARTS_BY_LOOP}))
    engine = start_engine(root / "engine.log", "--model", str(folder), "--quantization", "none", threads=1)
    gateway = start_gateway(root / "gateway.log", engine.address)
    yield folder, engine, gateway
    assert gateway.stop() == 0
    assert engine.stop() == 0


def test_the_openai_sdk_chats_with_a_llava_checkpoints_text_model(
    served: tuple[Path, EngineProcess, GatewayProcess],
) -> None:
    import transformers
    from transformers import AutoTokenizer

    folder, engine, gateway = served
    tokenizer = AutoTokenizer.from_pretrained(folder)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three colours."}]}]
    rendered = tokenizer.apply_chat_template(parts, chat_template=PARTS_BY_LOOP, tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    assert rendered == "<|user|>Name three colours.<end><|assistant|>"
    chat = types_pb2.ChatInput(messages=[types_pb2.ChatMessage(role="user", content="Name three colours.")])
    with EngineClient(engine.address) as client:
        info = client.model_info()
        assert info.architecture == "llama"
        tokenized = client.tokenize(engine_pb2.TokenizeRequest(input=types_pb2.Input(chat=chat)))
    assert tokenized.prompt_text == rendered
    prompt = list(tokenized.token_ids)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False)  # fmt: skip
    expected = tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)
    sdk = openai.OpenAI(base_url=gateway.base_url, api_key="unused")
    for content in ("Name three colours.", [{"type": "text", "text": "Name three colours."}]):
        reply = sdk.chat.completions.create(
            model=info.model_id, messages=[{"role": "user", "content": content}],  # type: ignore[misc, list-item]
            max_tokens=NEW_TOKENS, temperature=0.0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert reply.choices[0].message.content == expected
        assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
    picture = "data:image/png;base64," + base64.b64encode(png(1)).decode()
    with pytest.raises(openai.BadRequestError, match="no image processor") as refused:
        sdk.chat.completions.create(
            model=info.model_id, max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                    {"type": "image_url", "image_url": {"url": picture}}]}],
        )  # fmt: skip
    assert refused.value.param == "messages[0].content[1]"


@pytest.fixture(scope="module")
def qwen_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Any, EngineProcess, GatewayProcess]]:
    """A Qwen2.5-VL checkpoint that reads images, behind `ladle engine` and `ladle gateway`."""
    root = tmp_path_factory.mktemp("qwen2_5_vl")
    folder = root / "model"
    folder.mkdir()
    model = save_qwen_vl(folder, "qwen2_5_vl")
    engine = start_engine(root / "engine.log", "--model", str(folder), "--quantization", "none", threads=1)
    gateway = start_gateway(root / "gateway.log", engine.address, "--allowed-media-domains", "127.0.0.1")
    yield folder, model, engine, gateway
    assert gateway.stop() == 0
    assert engine.stop() == 0


@pytest.fixture(scope="module")
def picture_server() -> Iterator[str]:
    """An HTTP server on loopback serving `/picture.png` (`png(2)`); yields its base URL."""
    body = png(2)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/picture.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def test_the_openai_sdk_sends_images_to_a_qwen_vl_checkpoint(
    qwen_served: tuple[Path, Any, EngineProcess, GatewayProcess], picture_server: str
) -> None:
    """A data: URL image and an http one (fetched by the gateway) in one turn, whole and streamed: the reply is
    transformers' greedy tokens for the prompt its processor lays out (its token count the usage's prompt tokens)."""
    folder, model, _, gateway = qwen_served
    prompt = user("Compare", png(1), "with", png(2), "please.")
    inputs = qwen_inputs(folder, prompt)
    expected = transformers_greedy(model, inputs)
    sdk = openai.OpenAI(base_url=gateway.base_url, api_key="unused")
    content = [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png(1)).decode()}},
        {"type": "text", "text": "with"},
        {"type": "image_url", "image_url": {"url": f"{picture_server}/picture.png", "detail": "high"}},
        {"type": "text", "text": "please."},
    ]
    messages: Any = [{"role": "user", "content": content}]
    model_id = sdk.models.list().data[0].id
    reply = sdk.chat.completions.create(
        model=model_id, messages=messages, max_tokens=NEW_TOKENS, temperature=0.0, extra_body={"ignore_eos": True},
        logprobs=True,
    )  # fmt: skip
    assert reply.usage is not None and reply.usage.prompt_tokens == inputs["input_ids"].shape[1]
    assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.content is not None
    tokenizer = transformers_tokenizer(folder)
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    streamed = sdk.chat.completions.create(
        model=model_id, messages=messages, max_tokens=NEW_TOKENS, temperature=0.0, extra_body={"ignore_eos": True},
        stream=True,
    )  # fmt: skip
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == (
        reply.choices[0].message.content
    )
    with pytest.raises(openai.BadRequestError, match="404") as refused:
        sdk.chat.completions.create(
            model=model_id, max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image_url",
                                                    "image_url": {"url": f"{picture_server}/missing.png"}}]}],
        )  # fmt: skip
    assert refused.value.param == "messages[0].content[0].image_url.url"


def test_grpc_callers_send_image_bytes(qwen_served: tuple[Path, Any, EngineProcess, GatewayProcess]) -> None:
    """The engine's own API: a turn's `content_parts` with an image's bytes, answered as transformers answers; a part
    that is no image file is INVALID_ARGUMENT naming it."""
    import grpc

    folder, model, engine, _ = qwen_served
    prompt = user("What is in", png(3), "?")
    expected = transformers_greedy(model, qwen_inputs(folder, prompt))
    parts = [types_pb2.ContentPart(text="What is in"), types_pb2.ContentPart(image=types_pb2.Image(data=png(3))),
             types_pb2.ContentPart(text="?")]  # fmt: skip
    chat = types_pb2.ChatInput(messages=[types_pb2.ChatMessage(role="user", content_parts=parts)])
    params = types_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with EngineClient(engine.address) as client:
        result = client.generate(engine_pb2.GenerateRequest(input=types_pb2.Input(chat=chat), sampling=params))
        assert list(result.choices[0].token_ids) == expected
        broken = types_pb2.ChatInput(messages=[types_pb2.ChatMessage(
            role="user", content_parts=[types_pb2.ContentPart(image=types_pb2.Image(data=b"GIF89a broken"))])])
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(engine_pb2.GenerateRequest(input=types_pb2.Input(chat=broken), sampling=params))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].content[0]" in str(refused.value.details())


def transformers_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def audio_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Any, EngineProcess, GatewayProcess]]:
    """A Qwen2-Audio checkpoint that hears audio, behind `ladle engine` (two tensor-parallel ranks) and the gateway."""
    from tests.unit.test_audio_input import save_qwen2_audio

    root = tmp_path_factory.mktemp("qwen2_audio")
    folder = root / "model"
    model = save_qwen2_audio(folder)
    engine = start_engine(root / "engine.log", "--model", str(folder), "--quantization", "none",
                          "--tensor-parallel-size", "2", threads=1)  # fmt: skip
    gateway = start_gateway(root / "gateway.log", engine.address)
    yield folder, model, engine, gateway
    assert gateway.stop() == 0
    assert engine.stop() == 0


def test_the_openai_sdk_sends_audio_to_a_qwen2_audio_checkpoint(
    audio_served: tuple[Path, Any, EngineProcess, GatewayProcess],
) -> None:
    """OpenAI's `input_audio` parts (a WAV and an MP3, base64) in one turn, through the SDK to an engine of two ranks:
    the reply is transformers' greedy tokens for the prompt its processor lays out for the clips as the engine hears
    them; a part that is no audio file is a 400 naming it."""
    from tests.unit.test_audio_input import clip
    from tests.unit.test_audio_input import processor_inputs as audio_inputs
    from tests.unit.test_audio_input import user as audio_user

    folder, model, _, gateway = audio_served
    wav, mp3 = clip(1, 1.2), clip(2, 0.9, 22_050, 2, "MP3")
    inputs = audio_inputs(folder, audio_user("Compare", wav, "with", mp3, "please."))
    expected = transformers_greedy(model, inputs)
    sdk = openai.OpenAI(base_url=gateway.base_url, api_key="unused")

    def audio(data: bytes, fmt: str) -> dict[str, Any]:
        return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}

    content = [{"type": "text", "text": "Compare"}, audio(wav, "wav"), {"type": "text", "text": "with"},
               audio(mp3, "mp3"), {"type": "text", "text": "please."}]  # fmt: skip
    model_id = sdk.models.list().data[0].id
    reply = sdk.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": content}],  # type: ignore[misc, list-item]
        max_tokens=NEW_TOKENS, temperature=0.0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.usage is not None and reply.usage.prompt_tokens == inputs["input_ids"].shape[1]
    assert reply.choices[0].message.content == transformers_tokenizer(folder).decode(expected, skip_special_tokens=True)
    with pytest.raises(openai.BadRequestError, match="cannot be read") as refused:
        sdk.chat.completions.create(
            model=model_id, max_tokens=4,
            messages=[{"role": "user", "content": [audio(b"RIFF not a wave", "wav")]}],  # type: ignore[list-item]
        )  # fmt: skip
    assert refused.value.param == "messages[0].content[0]"
