"""Generation defaults: every source, the override, explicit fields winning, the max_tokens cap, GetModelInfo."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from engine_server.core.request import resolve_max_tokens
from engine_server.errors import ValidationError
from engine_server.frontend import ChatPrompt, Choice, GenerationResult, Usage
from engine_server.generation_defaults import (
    EMBEDDED_DEFAULTS,
    GenerationDefaults,
    resolve_generation_defaults,
)
from engine_server.output.types import FinishReason
from engine_server.pooling.params import ModelPooling
from engine_server.sampling_params import SamplingParams
from engine_server.server import convert
from engine_server.server.servicer import EngineServicer
from engine_server.server.serving import GenerationInput, ModelInfo, ServingEngine, StepUpdate
from engine_server.tokenizer.chat import ChatMessage
from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2

LADLE = GenerationDefaults()


def resolve(
    setting: str = "auto", override: str | None = None, spec: str = "some-model", folder: Path | None = None
) -> GenerationDefaults:
    return resolve_generation_defaults(setting, override, model_spec=spec, model_folder=folder)


def write_config(folder: Path, **values: Any) -> Path:
    path = folder / "generation_config.json"
    path.write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, **values}))
    return path


# -- sources ---------------------------------------------------------------------------------------------


def test_ladle_is_openai_defaults_whatever_the_model() -> None:
    assert resolve("ladle", spec="default") == LADLE
    assert LADLE.sampling_params() == SamplingParams()  # the same values as SamplingParams' own


def test_auto_reads_the_model_folders_generation_config(tmp_path: Path) -> None:
    write_config(tmp_path, temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1,
                 max_new_tokens=300, num_beams=1)  # fmt: skip
    defaults = resolve("auto", spec=str(tmp_path), folder=tmp_path)
    assert defaults == GenerationDefaults(
        temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=300,
        source=str(tmp_path / "generation_config.json"),
    )  # fmt: skip


def test_auto_keeps_ladle_values_for_missing_and_null_keys(tmp_path: Path) -> None:
    write_config(tmp_path, temperature=0.7, top_p=None)
    defaults = resolve("auto", spec=str(tmp_path), folder=tmp_path)
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.7, 1.0, 0, None)


def test_auto_on_the_embedded_model_takes_its_model_card_values() -> None:
    defaults = resolve("auto", spec="default", folder=None)
    assert defaults == EMBEDDED_DEFAULTS
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.2, 0.9, 512)


@pytest.mark.parametrize("spec", ["dummy:smollm2-135m", "model.gguf", "folder-without-the-file"])
def test_auto_without_a_generation_config_is_ladle(tmp_path: Path, spec: str) -> None:
    defaults = resolve("auto", spec=spec, folder=tmp_path)
    assert defaults.sampling_params() == SamplingParams() and defaults.source.startswith("ladle")


def test_auto_ignores_a_file_the_converted_gguf_folder_might_hold(tmp_path: Path) -> None:
    write_config(tmp_path, temperature=0.3)
    assert resolve("auto", spec="model.gguf", folder=tmp_path).temperature == 1.0


def test_a_path_to_the_file_or_to_its_folder(tmp_path: Path) -> None:
    path = write_config(tmp_path, temperature=0.4, max_new_tokens=64)
    for setting in (str(path), str(tmp_path)):
        defaults = resolve(setting, spec="default")  # a path wins over the embedded model's values
        assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.4, 1.0, 64)
        assert defaults.source == str(path)


def test_a_path_without_the_file_fails_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--generation-config .*no generation_config\.json"):
        resolve(str(tmp_path))
    with pytest.raises(ValueError, match="--generation-config"):
        resolve(str(tmp_path / "missing.json"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", "must be a JSON object"),
        ("{", "cannot read it as JSON"),
        ('{"top_p": 0}', r"top_p must be in \(0, 1\]"),
    ],
)
def test_a_bad_file_names_the_flag_and_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "generation_config.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as failed:
        resolve(str(path))
    assert "--generation-config" in str(failed.value) and str(path) in str(failed.value)


# -- the override ----------------------------------------------------------------------------------------


def test_the_override_wins_over_the_file(tmp_path: Path) -> None:
    write_config(tmp_path, temperature=0.6, top_p=0.95, max_new_tokens=300)
    override = '{"temperature": 0, "max_tokens": 32, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2}'
    defaults = resolve("auto", override, spec=str(tmp_path), folder=tmp_path)
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.0, 0.95, 5, 32)
    assert (defaults.min_p, defaults.repetition_penalty) == (0.1, 1.2)
    assert defaults.source.endswith("+ --override-generation-config")


def test_the_override_takes_max_new_tokens_and_null_resets_a_key() -> None:
    assert resolve("auto", '{"max_new_tokens": 7}', spec="default").max_tokens == 7
    lifted = resolve("auto", '{"max_tokens": null}', spec="default")  # the embedded cap lifted: up to the context
    assert (lifted.max_tokens, lifted.temperature) == (None, 0.2)
    assert resolve("ladle", "", spec="default") == LADLE  # "" (the flag's default) is no override


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ('{"temprature": 0.5}', "unknown keys \\['temprature'\\]"),
        ('{"do_sample": false}', "unknown keys"),
        ("[0.5]", "must be a JSON object"),
        ("temperature=0.5", "not valid JSON"),
        ('{"temperature": 3}', r"temperature must be in \[0, 2\]"),
        ('{"temperature": NaN}', "temperature must be a finite number"),
        ('{"temperature": "hot"}', "temperature must be a number"),
        ('{"top_p": 1.5}', r"top_p must be in \(0, 1\]"),
        ('{"top_k": -2}', "top_k must be -1 or 0"),
        ('{"top_k": 2.5}', "top_k must be an integer"),
        ('{"min_p": -0.1}', r"min_p must be in \[0, 1\]"),
        ('{"repetition_penalty": 0}', "repetition_penalty must be > 0"),
        ('{"max_tokens": 0}', "max_tokens must be at least 1"),
        ('{"max_tokens": true}', "max_tokens must be an integer"),
        ('{"max_tokens": 5, "max_new_tokens": 6}', "not both"),
    ],
)
def test_a_bad_override_is_a_clear_error_naming_the_flag(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as failed:
        resolve("ladle", override)
    assert str(failed.value).startswith("--override-generation-config")


# -- applying them ---------------------------------------------------------------------------------------

SMALL = GenerationDefaults(temperature=0.2, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1, max_tokens=512)


def test_omitted_proto_fields_take_the_defaults() -> None:
    params = convert.sampling_params(types_pb2.SamplingParams(), SMALL)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        0.2, 0.9, 40, 0.05, 1.1,
    )  # fmt: skip
    assert params.max_tokens is None and params.default_max_tokens == 512
    assert (params.n, params.seed, params.presence_penalty, params.skip_special_tokens) == (1, None, 0.0, True)


def test_explicit_proto_fields_win_over_the_defaults() -> None:
    message = types_pb2.SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                                       max_tokens=2000)  # fmt: skip
    params = convert.sampling_params(message, SMALL)
    assert params == SamplingParams(max_tokens=2000)  # exactly OpenAI's values, and no default cap


def test_offline_fields_given_win_and_the_others_take_the_defaults() -> None:
    params = SMALL.sampling_params(temperature=0.0, max_tokens=8)
    assert (params.temperature, params.top_p, params.max_tokens, params.default_max_tokens) == (0.0, 0.9, 8, None)
    assert SMALL.sampling_params(max_tokens=None).default_max_tokens is None  # explicitly up to the context


def test_the_default_cap_shrinks_to_the_context_and_never_below_min_tokens() -> None:
    omitted = SMALL.sampling_params()
    assert resolve_max_tokens(omitted, num_prompt_tokens=10, max_model_len=8192) == 512
    # Near the end of the context the default shrinks, as "up to the context" did; an explicit 512 is refused.
    omitted.validate(vocab_size=100, max_model_len=8192, prompt_len=8000)
    assert resolve_max_tokens(omitted, num_prompt_tokens=8000, max_model_len=8192) == 192
    with pytest.raises(ValidationError, match="maximum context length"):
        SMALL.sampling_params(max_tokens=512).validate(vocab_size=100, max_model_len=8192, prompt_len=8000)
    assert resolve_max_tokens(SMALL.sampling_params(min_tokens=600), 10, 8192) == 600
    assert resolve_max_tokens(LADLE.sampling_params(), 10, 8192) == 8182  # ladle: up to the context as before


# -- over gRPC -------------------------------------------------------------------------------------------


class FakeServing:
    """What the servicer needs of a ServingEngine: `info`, its adapters (none: LoRA off), and `generate` (records
    each request, answers "ok")."""

    lora_limits = None

    def __init__(self, defaults: GenerationDefaults) -> None:
        self.info = ModelInfo(
            model_id="m", architecture="llama", context_length=8192, vocab_size=100, eos_token_ids=(2,),
            has_chat_template=True, device="cpu", dtype="float32", max_num_seqs=4, generation_defaults=defaults,
            pooling=ModelPooling.for_model(None, 64),
        )  # fmt: skip
        self.requests: list[GenerationInput] = []

    def served_adapters(self) -> list[Any]:
        return []

    async def generate(
        self, request: GenerationInput, deadline: Any = None, whole: bool = False, wait: bool = False
    ) -> AsyncIterator[Any]:
        self.requests.append(request)
        choice = Choice(0, "ok", [5], FinishReason.STOP)
        yield StepUpdate([choice], GenerationResult(request.request_id, [1], [choice], Usage(1, 1)), finished=True)


async def test_get_model_info_reports_the_defaults_and_generate_applies_them() -> None:
    defaults = resolve("ladle", '{"temperature": 0.3, "top_p": 0.8, "min_p": 0.02, "max_tokens": 100}')
    engine = FakeServing(defaults)
    servicer = EngineServicer()
    servicer.attach(cast(ServingEngine, engine))
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=5)
            request = engine_pb2.GenerateRequest(input=types_pb2.Input(text="hi"))
            await stub.Generate(request, timeout=5)
            request.sampling.temperature = 1.5
            await stub.Generate(request, timeout=5)
    finally:
        await server.stop(0)
    got = info.defaults
    assert (got.temperature, got.top_p, got.min_p) == pytest.approx((0.3, 0.8, 0.02))
    assert (got.top_k, got.repetition_penalty, got.max_tokens) == (0, 1.0, 100)
    omitted, explicit = (r.params for r in engine.requests)
    assert (omitted.temperature, omitted.top_p, omitted.default_max_tokens) == (0.3, 0.8, 100)
    assert (explicit.temperature, explicit.top_p) == (1.5, 0.8)


def test_model_info_reports_no_cap_as_zero() -> None:
    info = FakeServing(LADLE).info
    reply = convert.model_info_response(info)
    assert (reply.defaults.temperature, reply.defaults.max_tokens, reply.defaults.min_p) == (1.0, 0, 0.0)


# -- the offline API -------------------------------------------------------------------------------------


def test_llm_applies_the_embedded_defaults_to_omitted_params(llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert llm.generation_defaults == EMBEDDED_DEFAULTS
    assert llm.sampling_params(max_tokens=4).temperature == 0.2
    seen: list[SamplingParams] = []
    prepare = llm.inputs.prepare

    def spy(prompt: Any, params: SamplingParams) -> Any:
        seen.append(params)
        return prepare(prompt, params)

    monkeypatch.setattr(llm.inputs, "prepare", spy)
    result = llm.generate(ChatPrompt([ChatMessage(role="user", content="Say hello.")]), use_tqdm=False)[0]
    assert seen == [EMBEDDED_DEFAULTS.sampling_params()]
    assert result.choices[0].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert result.usage.completion_tokens <= 512
    llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
    assert seen[-1] == SamplingParams(max_tokens=1)  # a given SamplingParams is used as it is


def test_generation_config_eos_ids_are_read_and_never_fail(tmp_path: Path) -> None:
    """generation_config.json's `eos_token_id` (an id or a list: gpt-oss lists `<|call|>` there) adds end-of-sequence
    ids; a folder without the file, a broken file or odd values add none and raise nothing."""
    from engine_server.generation_defaults import generation_config_eos_ids

    assert generation_config_eos_ids(tmp_path) == ()
    path = tmp_path / "generation_config.json"
    for text, ids in (('{"eos_token_id": [200002, 199999, 200012]}', (200002, 199999, 200012)),
                      ('{"eos_token_id": 7}', (7,)), ('{"eos_token_id": [true, -1, "x", 3]}', (3,)),
                      ("{nope", ()), ("[1]", ()), ('{"temperature": 0.6}', ())):  # fmt: skip
        path.write_text(text)
        assert generation_config_eos_ids(tmp_path) == ids, text
