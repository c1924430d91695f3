"""The engine's front: every bad input is refused before the step loop, and the engine keeps serving."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from engine_server import LLM, ChatPrompt, SamplingParams
from engine_server.errors import ModelTemplateError, ValidationError
from engine_server.frontend import InputProcessor, RequestTracker, core_request_id, split_core_request_id
from engine_server.tokenizer.chat import ChatMessage, ChatTool, ChatToolCall, content_as_parts, render_chat

pytestmark = pytest.mark.slow  # the embedded model's offline engine

VOCAB = 49152
MAX_LEN = 2048


@pytest.fixture(scope="module")
def inputs(smollm2_tokenizer: Any) -> InputProcessor:
    return InputProcessor(smollm2_tokenizer, VOCAB, MAX_LEN, eos_token_ids=[2])


def _refused(param: str, call: Any) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        call()
    assert info.value.param == param, info.value.message
    return info.value


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        ("", "prompt"),
        ([], "prompt"),
        ([1, 2, VOCAB], "prompt"),
        ([1, -1], "prompt"),
        (ChatPrompt([]), "messages"),
        (ChatPrompt([ChatMessage(role="wizard", content="hi")]), "messages"),
        (ChatPrompt([ChatMessage("user", "hi")], template_kwargs={"chat_template": "{{ 1 }}"}), "chat_template_kwargs"),
        # A lone surrogate (JSON's "\ud800" escape) cannot be tokenized; schema fuzzing found it in a tool's
        # parameters, which reach the template as parsed JSON.
        ("a\ud800b", "prompt"),
        (ChatPrompt([ChatMessage("user", "hi")], tools=[ChatTool("f", "", {"description": "\udfff"})]), "messages"),
    ],
)
def test_bad_inputs_are_refused_with_their_param(inputs: InputProcessor, prompt: Any, param: str) -> None:
    def run() -> None:
        inputs.make_requests("r", inputs.tokenize(prompt), SamplingParams())

    _refused(param, run)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(max_tokens=MAX_LEN), "max_tokens"),
        (SamplingParams(logit_bias={VOCAB + 5: 1.0}), "logit_bias"),
        (SamplingParams(stop_token_ids=(VOCAB,)), "stop_token_ids"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(n=17), "n"),
        (SamplingParams(stop=tuple(str(i) for i in range(17))), "stop"),
        (SamplingParams(logprobs=True, top_logprobs=21), "top_logprobs"),
    ],
)
def test_bad_parameters_are_refused_before_any_request_exists(
    inputs: InputProcessor, params: SamplingParams, param: str
) -> None:
    _refused(param, lambda: inputs.make_requests("r", [1, 2, 3], params))


def test_context_overflow_message_names_both_numbers(inputs: InputProcessor) -> None:
    error = _refused("max_tokens", lambda: inputs.make_requests("r", [5] * 2000, SamplingParams(max_tokens=100)))
    assert "2000" in error.message and str(MAX_LEN) in error.message


def test_n_expands_into_choice_requests_with_distinct_seeds(inputs: InputProcessor) -> None:
    requests = inputs.make_requests("req", [1, 2, 3], SamplingParams(n=3, seed=10))
    assert [r.request_id for r in requests] == ["req/0", "req/1", "req/2"]
    assert [r.sampling_params.seed for r in requests] == [10, 11, 12]
    assert split_core_request_id(core_request_id("a/b", 2)) == ("a/b", 2)


def test_chat_renders_with_the_model_template_including_tool_turns(smollm2_tokenizer: Any) -> None:
    messages = [
        ChatMessage("system", "You are terse."),
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "", tool_calls=(ChatToolCall("call_1", "weather", '{"city": "Paris"}'),)),
        ChatMessage("tool", "18C and sunny", tool_call_id="call_1"),
    ]
    tools = [ChatTool("weather", "Current weather", {"type": "object", "properties": {"city": {"type": "string"}}})]
    text = render_chat(smollm2_tokenizer, messages, tools)
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    assert "18C and sunny" in text and text.endswith("<|im_start|>assistant\n")


# Templates that read a turn's content as a list of parts alone, in the two ways multimodal checkpoints write them
# (LLaVA's: parts filtered by type; Idefics's and SmolVLM's: a loop testing each part's type), and one that takes a
# string or parts (Gemma 3's and Qwen2.5-VL's way).
PARTS_BY_FILTER = (
    "{% for m in messages %}{{ m['role'].upper() + ': ' }}"
    "{% for part in m['content'] | selectattr('type', 'equalto', 'text') %}{{ part['text'] + ' ' }}{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
PARTS_BY_LOOP = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}<image>{% endif %}"
    "{% endfor %}<end>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
STRING_OR_PARTS = (
    "{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize(
    ("template", "parts", "expected"),
    [
        (PARTS_BY_FILTER, True, "SYSTEM: Be brief. USER: Hi there ASSISTANT: Hello USER: Again? ASSISTANT:"),
        (PARTS_BY_LOOP, True, "<|system|>Be brief.<end><|user|>Hi there<end><|assistant|>Hello<end><|user|>Again?<end>"
                              "<|assistant|>"),
        (STRING_OR_PARTS, False, "<system>Be brief.<user>Hi there<assistant>Hello<user>Again?"),
    ],
)
def test_a_template_that_reads_content_as_parts_gets_each_turns_text_as_one(
    smollm2_tokenizer: Any, template: str, parts: bool, expected: str
) -> None:
    """A chat template that reads a turn's content as a list of OpenAI parts alone (LLaVA's, Idefics's) gets each
    turn's text as one text part, which a string would not reach; one that takes strings gets strings."""
    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = template
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there"), ChatMessage("assistant", "Hello"),
                ChatMessage("user", "Again?")]  # fmt: skip
    assert content_as_parts(tokenizer) is parts
    assert render_chat(tokenizer, messages) == expected


def test_a_processors_chat_template_is_read_where_the_tokenizer_has_none(tmp_path: Path) -> None:
    """LLaVA's and Idefics's checkpoints keep their template in the processor's `chat_template.json`, which
    transformers' tokenizers do not read: the engine does, where the tokenizer has no template of its own."""
    from engine_server.tokenizer.loading import load_tokenizer
    from tests.unit.pooling.embedding_models import copy_tokenizer

    copy_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert not load_tokenizer(tmp_path).chat_template
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": PARTS_BY_LOOP}))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.chat_template == PARTS_BY_LOOP
    assert render_chat(tokenizer, [ChatMessage("user", "Hi")]) == "<|user|>Hi<end><|assistant|>"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(inputs: InputProcessor) -> None:
    """vLLM's truncate_prompt_tokens: a text's, token ids' or a chat's rendered tokens cut to their last k (-1: as many
    as the context holds); 0 and below -1 are refused."""
    ids = list(range(10, 30))
    assert inputs.prepare(ids, SamplingParams(truncate_prompt_tokens=5)).token_ids == ids[-5:]
    assert inputs.prepare(ids, SamplingParams(truncate_prompt_tokens=50)).token_ids == ids
    long = list(range(10, 10 + MAX_LEN + 7))
    assert inputs.prepare(long, SamplingParams(truncate_prompt_tokens=-1)).token_ids == long[-MAX_LEN:]
    text = "one two three four five six seven"
    assert inputs.prepare(text, SamplingParams(truncate_prompt_tokens=3)).token_ids == inputs.tokenize(text)[-3:]
    chat = ChatPrompt([ChatMessage("user", "What is the capital of France?")])
    whole = inputs.prepare(chat, SamplingParams()).token_ids
    assert inputs.prepare(chat, SamplingParams(truncate_prompt_tokens=4)).token_ids == whole[-4:]
    for bad in (0, -2):
        _refused("truncate_prompt_tokens", lambda: inputs.prepare(ids, SamplingParams(truncate_prompt_tokens=bad)))  # noqa: B023


def test_bad_words_become_their_token_sequences_as_vllm_makes_them(inputs: InputProcessor, smollm2_tokenizer: Any
                                                                   ) -> None:  # fmt: skip
    def encode(text: str) -> tuple[int, ...]:
        return tuple(smollm2_tokenizer.encode(text, add_special_tokens=False))

    prepared = inputs.prepare("Hello", SamplingParams(bad_words=("Paris", "  New York")))
    assert prepared.params.bad_word_token_ids == (encode("Paris"), encode(" Paris"), encode("New York"),
                                                  encode(" New York"))  # fmt: skip
    assert encode("Paris") != encode(" Paris")
    _refused("bad_words", lambda: inputs.prepare("Hello", SamplingParams(bad_words=(" ",))))
    _refused("bad_words", lambda: inputs.prepare("Hello", SamplingParams(bad_words=("x",) * 17)))


def test_documents_reach_a_template_that_reads_them(smollm2_tokenizer: Any) -> None:
    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = ("{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                               "{% for m in messages %}{{ m.content }}{% endfor %}")  # fmt: skip
    documents = [{"title": "A", "text": "one"}, {"title": "B", "text": "two"}]
    hi = [ChatMessage("user", "hi")]
    assert render_chat(tokenizer, hi, documents=documents) == "[A: one][B: two]hi"
    assert render_chat(tokenizer, hi) == "hi"


def test_continue_final_message_cuts_the_template_after_the_last_message(smollm2_tokenizer: Any) -> None:
    """transformers' (and vLLM's) continue_final_message: the rendered text ends with the last message's content, its
    turn left open, so the output goes on from it; it needs add_generation_prompt false, and a last message the
    template does not write as given is refused."""
    begun = [ChatMessage("user", "What is the capital of France?"), ChatMessage("assistant", "The capital is")]
    whole = render_chat(smollm2_tokenizer, begun, add_generation_prompt=False)
    text = render_chat(smollm2_tokenizer, begun, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe capital is") and whole.startswith(text) and whole != text
    with pytest.raises(ValidationError) as both:
        render_chat(smollm2_tokenizer, begun, continue_final_message=True)
    assert both.value.param == "add_generation_prompt"
    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content | upper }}{% endfor %}"
    with pytest.raises(ValidationError) as unwritten:
        render_chat(tokenizer, begun, add_generation_prompt=False, continue_final_message=True)
    assert unwritten.value.param == "messages"


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.system('false') }}",
        "{% set _ = messages.append({'role': 'system', 'content': 'x'}) %}",
    ],
)
def test_a_template_that_leaves_the_sandbox_is_the_models_fault(smollm2_tokenizer: Any, template: str) -> None:
    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = template
    with pytest.raises(ModelTemplateError, match=r"attempted an operation its sandbox forbids .* is unsafe"):
        render_chat(tokenizer, [ChatMessage("user", "hi")])
    tokenizer.chat_template = "{{ raise_exception('no system turn allowed') }}"  # the caller's fault
    with pytest.raises(ValidationError, match="the chat template rejected the messages: no system turn allowed"):
        render_chat(tokenizer, [ChatMessage("user", "hi")])


def test_text_prompts_get_the_tokenizers_special_tokens(inputs: InputProcessor, smollm2_tokenizer: Any) -> None:
    ids = inputs.tokenize("Hello there")
    assert ids == smollm2_tokenizer.encode("Hello there", add_special_tokens=True)


def test_a_bad_prompt_in_a_batch_fails_the_call_before_work_and_the_engine_keeps_serving(llm: LLM) -> None:
    good = "Say yes."
    with pytest.raises(ValidationError):
        llm.generate([good, [1, VOCAB + 1]], SamplingParams(max_tokens=4))
    assert not llm.core.has_unfinished()
    result = llm.generate(good, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert len(result.choices[0].token_ids) >= 1


class _StreamingTracker(RequestTracker):
    """The tracker as a streaming caller uses it: every step's output applied as it comes."""

    @property
    def needs_every_step(self) -> bool:
        return True


@pytest.fixture(scope="module")
def uncached_llm() -> LLM:
    """The embedded model without prefix caching: a rerun of the same prompts computes exactly the same."""
    from engine_server.config import CacheConfig, EngineConfig

    return LLM(config=EngineConfig(device="cpu", cache=CacheConfig(memory_bytes=512 * 1024**2,
                                                                   enable_prefix_caching=False)))


def test_offline_results_equal_applying_every_step_as_it_comes(
    uncached_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LLM.generate holds a choice's tokens until it finishes and applies them at once; nothing may change."""
    llm = uncached_llm
    prompts = [
        ChatPrompt([ChatMessage(role="user", content="Name three colours.")]),
        "你好，世界。Tell me about 😀 in one line:",
        ChatPrompt([ChatMessage(role="user", content="Count from 1 to 10.")]),
        [1, 2, 3, 4, 5],
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=True, top_logprobs=3),  # eos or length
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=16),
        SamplingParams(temperature=0.0, max_tokens=40, stop=["4."]),  # matched as the text grows
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    ]
    offline = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr("engine_server.llm.RequestTracker", _StreamingTracker)
    streamed = llm.generate(prompts, params, use_tqdm=False)

    def comparable(result: Any) -> Any:
        return result.prompt_token_ids, result.choices, result.usage

    assert [comparable(r) for r in offline] == [comparable(r) for r in streamed]
    assert offline[2].choices[0].matched_stop == "4." and all(c.text for r in offline for c in r.choices)
    assert offline[0].choices[0].logprobs and len(offline[1].choices) == 2
