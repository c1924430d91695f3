"""A multimodal checkpoint served as its text model end to end: a LLaVA checkpoint as transformers saves it, its chat
template where LLaVA's releases keep it (the processor's `chat_template.json`, read as a list of parts alone), behind
`ladle engine --model FOLDER --quantization none` and `ladle gateway`, through the official openai SDK: the prompt is
what the template renders for OpenAI's text parts, the reply transformers' greedy tokens for it, whether the caller
sends a string or text parts; an image part is refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from ladle.client import EngineClient
from ladle.v1 import engine_pb2, types_pb2
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, start_gateway
from tests.unit.test_frontend import PARTS_BY_LOOP
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
    with pytest.raises(openai.BadRequestError, match="content part type 'image_url' is not supported") as refused:
        sdk.chat.completions.create(
            model=info.model_id, max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                    {"type": "image_url", "image_url": {"url": "data:,"}}]}],
        )  # fmt: skip
    assert refused.value.param == "messages[0].content[1].type"
