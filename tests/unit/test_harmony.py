"""gpt-oss's harmony output read apart (`engine_server.harmony`): reasoning, content and tool calls, whatever way the
text is split as it streams."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from engine_server.frontend import ChatPrompt, InputProcessor
from engine_server.harmony import HarmonyCall, HarmonyDelta, HarmonyStream, is_harmony_template
from engine_server.sampling_params import SamplingParams
from engine_server.tokenizer.chat import ChatMessage
from tests.chat_templates import GPT_OSS

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


def test_templates_are_told_by_their_channel_headers() -> None:
    assert is_harmony_template("{{ '<|start|>assistant<|channel|>final<|message|>' }}")
    assert not is_harmony_template("<|im_start|>assistant") and not is_harmony_template(None)


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
