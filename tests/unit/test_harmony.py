"""gpt-oss's harmony output read apart (`engine_server.harmony`): reasoning, content and tool calls, whatever way the
text is split as it streams."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import xgrammar as xgr

from engine_server.frontend import ChatPrompt, InputProcessor
from engine_server.harmony import HarmonyCall, HarmonyDelta, HarmonyStream
from engine_server.sampling_params import SamplingParams
from engine_server.structured import Constraint
from engine_server.structured.compiler import GrammarCompilerConfig, XGrammarCompile, build_tokenizer_info
from engine_server.tokenizer.chat import ChatMessage, ChatTool
from engine_server.tools.grammar import forced_call_constraint
from engine_server.tools.template import ToolFormat
from engine_server.tools.types import ToolChoice, ToolChoiceMode
from tests.chat_templates import GPT_OSS
from tests.scripted import save_scripted_model

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Rome."


def read(text: str, reads_calls: bool = True, pieces: int = 1) -> HarmonyDelta:
    """The stream's whole output for `text` fed in `pieces`-character pieces (1: whole)."""
    stream, total = HarmonyStream(reads_calls), HarmonyDelta()
    step = max(1, len(text)) if pieces == 1 else pieces
    for start in range(0, len(text), step):
        total.extend(stream.feed(text[start : start + step]))
    total.extend(stream.finish())
    return total


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_reasoning_and_answer_at_every_split(piece: int) -> None:
    got = read(ANALYSIS + FINAL, pieces=piece)
    assert (got.reasoning, got.content, got.calls) == ("The user wants the weather.", "It is sunny in Rome.", [])


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_a_call_after_reasoning_is_released_whole(piece: int) -> None:
    got = read(ANALYSIS + CALL, pieces=piece)
    assert got.reasoning == "The user wants the weather." and got.content == ""
    assert got.calls == [HarmonyCall("get_weather", '{"city": "Rome"}')]


def test_recipient_before_the_channel_and_several_calls() -> None:
    text = ('<|channel|>commentary to=functions.a json<|message|>{"x": 1}<|end|>'
            '<|start|>assistant to=functions.b<|channel|>commentary <|constrain|>json<|message|>{"y": 2}')  # fmt: skip
    assert read(text).calls == [HarmonyCall("a", '{"x": 1}'), HarmonyCall("b", '{"y": 2}')]


def test_without_tools_calls_are_not_read_and_preambles_are_content() -> None:
    text = ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL
    got = read(text, reads_calls=False)
    assert got.calls == [] and got.content == "Checking."
    assert got.reasoning == 'The user wants the weather.{"city": "Rome"}'  # a message to a recipient is not shown


def test_text_without_harmony_headers_is_content_as_written() -> None:
    for text in ('{"answer": 4}', "  plain", "<|chan"):
        assert read(text).content == text
    assert read("").content == ""


def test_a_reply_cut_off_keeps_what_it_wrote() -> None:
    """max_tokens inside the reasoning: reasoning, no content; inside a call: the call as far as it went; inside
    a header: nothing of it; a partial end marker at the very end: text as written."""
    cut = read("<|channel|>analysis<|message|>Thinking ab")
    assert (cut.reasoning, cut.content) == ("Thinking ab", "")
    assert read(ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.f<|message|>{"a"').calls == [
        HarmonyCall("f", '{"a"')
    ]
    got = read(ANALYSIS + "<|start|>assistant<|chan")
    assert (got.reasoning, got.content) == ("The user wants the weather.", "")
    assert read(ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Done<|en").content == "Done<|en"


def test_reasoning_end_marks_the_last_reasoning_message() -> None:
    stream = HarmonyStream(True)
    stream.feed(ANALYSIS + FINAL)
    assert stream.reasoning_end == len(ANALYSIS)


def test_a_harmony_template_or_vllms_parser_names_turn_harmony_on(smollm2_tokenizer: Any) -> None:
    """A template with `<|channel|>` headers (or `--tool-call-parser openai` / `--reasoning-parser openai_gptoss`,
    vLLM's names) reads the output as harmony: special tokens kept, no <think> split; otherwise nothing changes."""
    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = GPT_OSS.template
    prompt = ChatPrompt([ChatMessage("user", "Hi")])
    prepared = InputProcessor(tokenizer, 49152, 2048, eos_token_ids=[2]).prepare(prompt, SamplingParams())
    assert prepared.harmony and not prepared.params.skip_special_tokens and prepared.reasoning is None
    for flags in ({"tool_call_parser": "openai"}, {"reasoning_parser": "openai_gptoss"}):
        forced = InputProcessor(smollm2_tokenizer, 49152, 2048, eos_token_ids=[2], **flags)
        assert forced.harmony and not forced.splits_reasoning, flags
    plain = InputProcessor(smollm2_tokenizer, 49152, 2048, eos_token_ids=[2]).prepare(prompt, SamplingParams())
    assert not plain.harmony and plain.params.skip_special_tokens


@pytest.fixture(scope="module")
def harmony_compile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, XGrammarCompile]:
    """A tokenizer with harmony's control tokens as special tokens (tests/scripted.py), and the engine's compile
    function over it."""
    from transformers import AutoTokenizer

    folder = save_scripted_model(tmp_path_factory.mktemp("harmony"), GPT_OSS.template, {"assistant": ("<|return|>",)},
                                 GPT_OSS.special_tokens, GPT_OSS.bos, GPT_OSS.eos, GPT_OSS.stops)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(folder)
    stops = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    info = build_tokenizer_info(tokenizer, len(tokenizer), stops)
    return tokenizer, XGrammarCompile(info, GrammarCompilerConfig())


def accepts(harmony_compile: tuple[Any, XGrammarCompile], constraint: Constraint, text: str, stop: str) -> bool:
    """Whether the compiled `constraint` takes `text` (special tokens as themselves) and then ends at `stop`."""
    tokenizer, compile_fn = harmony_compile
    matcher = xgr.GrammarMatcher(compile_fn(constraint))
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.convert_tokens_to_ids(stop)]
    return all(matcher.accept_token(i) for i in ids) and matcher.is_terminated()


def test_a_json_schema_constrains_the_final_channel_after_free_reasoning(
    harmony_compile: tuple[Any, XGrammarCompile],
) -> None:
    schema = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    harmony = schema.after("harmony")
    final = '<|channel|>final<|message|>{"a": 4}'
    assert accepts(harmony_compile, harmony, ANALYSIS + "<|start|>assistant" + final, "<|return|>")
    assert accepts(harmony_compile, harmony, final, "<|return|>")
    assert not accepts(harmony_compile, harmony, '<|channel|>final<|message|>{"a": "x"}', "<|return|>")
    assert not accepts(harmony_compile, harmony, '{"a": 4}', "<|return|>")  # the answer without its header
    assert accepts(harmony_compile, schema, '{"a": 4}', "<|return|>")  # without after_reasoning: the whole output


def test_a_forced_call_is_harmonys_call_message_after_free_reasoning(
    harmony_compile: tuple[Any, XGrammarCompile],
) -> None:
    tools = [ChatTool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}}),
             ChatTool("get_time", "", {"type": "object", "properties": {}})]  # fmt: skip
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}'
    required = forced_call_constraint(tools, ToolChoice(ToolChoiceMode.REQUIRED), ToolFormat.HARMONY)
    named = forced_call_constraint(tools, ToolChoice(ToolChoiceMode.FUNCTION, "get_time"), ToolFormat.HARMONY)
    assert accepts(harmony_compile, required, ANALYSIS + "<|start|>assistant" + call, "<|call|>")
    assert accepts(harmony_compile, required, call, "<|call|>")
    assert not accepts(harmony_compile, required, FINAL.removeprefix("<|start|>assistant"), "<|return|>")
    assert not accepts(harmony_compile, named, call, "<|call|>")
    assert accepts(harmony_compile, named, "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}",
                   "<|call|>")  # fmt: skip
