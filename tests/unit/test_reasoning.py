"""Reasoning split from the answer: where it starts (read off the prompt), a stream cut anywhere, and the families'
own tags (Seed-OSS's, Magistral's: read off the template or named, kept as special tokens where they are some)."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest

from engine_server.config import REASONING_PARSERS
from engine_server.frontend import ChatPrompt, InputProcessor
from engine_server.reasoning import (
    COHERE_THINK,
    GEMMA4_THINK,
    MISTRAL_THINK,
    SEED_THINK,
    THINK,
    MarkerFilter,
    ReasoningStart,
    ReasoningStream,
    ReasoningTags,
    parser_reasoning_tags,
    reasoning_start,
    template_reasoning_tags,
)
from engine_server.sampling_params import SamplingParams
from engine_server.tokenizer.chat import ChatMessage

INSIDE, IF_OPENED = ReasoningStart.INSIDE, ReasoningStart.IF_OPENED


@pytest.mark.parametrize(
    ("prompt", "start"),
    [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", IF_OPENED),  # Qwen3, thinking on
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", None),  # Qwen3 with enable_thinking: false
        ("<｜User｜>Hi<｜Assistant｜><think>\n", INSIDE),  # DeepSeek-R1 opens it in the prompt
        ("user: what is <think>? assistant: ", IF_OPENED),  # a tag the user wrote, not at the end
        ("earlier <think>a</think> reply. user: more <|im_start|>assistant\n", IF_OPENED),  # history
    ],
)
def test_where_the_reasoning_starts_is_read_off_the_prompt(prompt: str, start: ReasoningStart | None) -> None:
    assert reasoning_start(prompt) is start


def _split(text: str, start: ReasoningStart, cuts: list[int], tags: ReasoningTags = THINK) -> tuple[str, str]:
    stream = ReasoningStream(start, tags)
    reasoning = content = ""
    for begin, end in itertools.pairwise([0, *cuts, len(text)]):
        r, c = stream.feed(text[begin:end])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


CASES = [
    ("<think>\nLet me add 2 and 2.\n</think>\n\nIt is 4.", IF_OPENED, "\nLet me add 2 and 2.\n", "It is 4."),
    ("\n<think>short</think>4", IF_OPENED, "short", "4"),
    ("It is 4.", IF_OPENED, "", "It is 4."),
    ("<thin", IF_OPENED, "", "<thin"),  # the start of a tag that never came is content
    ("  ", IF_OPENED, "", "  "),
    ("Let me add.\n</think>\n\nIt is 4.", INSIDE, "Let me add.\n", "It is 4."),
    ("Still thinking when max_tokens cut", INSIDE, "Still thinking when max_tokens cut", ""),
    ("cut at the tag </thi", INSIDE, "cut at the tag </thi", ""),
    ("a < b, </think>done. <think> stays", INSIDE, "a < b, ", "done. <think> stays"),
    ("<think>x</think>\n\n", IF_OPENED, "x", ""),
]


@pytest.mark.parametrize(("text", "start", "reasoning", "content"), CASES)
def test_a_stream_cut_anywhere_splits_like_the_whole_text(
    text: str, start: ReasoningStart, reasoning: str, content: str
) -> None:
    assert _split(text, start, []) == (reasoning, content)
    for cut in range(1, len(text)):
        assert _split(text, start, [cut]) == (reasoning, content), cut
    assert _split(text, start, list(range(1, len(text)))) == (reasoning, content)


@pytest.mark.parametrize("tags", [SEED_THINK, MISTRAL_THINK, COHERE_THINK, GEMMA4_THINK])
@pytest.mark.parametrize(("text", "start", "reasoning", "content"), CASES)
def test_a_familys_own_tags_split_as_think_does(
    tags: ReasoningTags, text: str, start: ReasoningStart, reasoning: str, content: str
) -> None:
    def retag(s: str) -> str:  # whole tags, then the partial ones of the cases ("<thin" is "[THIN" for Magistral)
        s = s.replace("</think>", "\0").replace("<think>", "\1")
        s = s.replace("</thi", tags.close[:5]).replace("<thin", tags.open[:5])
        return s.replace("\0", tags.close).replace("\1", tags.open)

    text, reasoning, content = retag(text), retag(reasoning), retag(content)
    whole = _split(text, start, [], tags)
    assert whole == (reasoning, content)
    for cut in range(1, len(text)):
        assert _split(text, start, [cut], tags) == whole, cut
    assert reasoning_start(f"user: hi{tags.open}\n", tags) is INSIDE
    assert reasoning_start(f"user: hi{tags.open}{tags.close}", tags) is None


def test_a_partial_tag_is_held_and_reasoning_streams_as_it_comes() -> None:
    stream = ReasoningStream(IF_OPENED)
    assert stream.feed("<th") == ("", "") and not stream.in_reasoning  # not yet
    assert stream.feed("ink>Adding") == ("Adding", "") and stream.in_reasoning
    assert stream.feed(" two.</") == (" two.", "")
    assert stream.feed("think>\n") == ("", "") and not stream.in_reasoning
    assert stream.feed("Four.") == ("", "Four.")
    assert stream.finish() == ("", "")


QWEN3_LIKE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)
R1_LIKE = "{%- for m in messages %}<｜User｜>{{ m.content }}{%- endfor %}<｜Assistant｜><think>\n"


@pytest.mark.parametrize(
    ("template", "kwargs", "start"),
    [
        (QWEN3_LIKE, None, IF_OPENED),
        (QWEN3_LIKE, {"enable_thinking": True}, IF_OPENED),
        (QWEN3_LIKE, {"enable_thinking": False}, None),  # splits nothing
        (R1_LIKE, None, INSIDE),
    ],
)
def test_a_thinking_template_turns_the_split_on_and_its_prompt_says_where(
    smollm2_tokenizer: Any, template: str, kwargs: dict[str, Any] | None, start: ReasoningStart | None
) -> None:
    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = template
    inputs = InputProcessor(tokenizer, 49152, 2048, eos_token_ids=[2])
    assert inputs.splits_reasoning  # auto: the template mentions <think>
    prompt = ChatPrompt([ChatMessage("user", "What is 2 + 2?")], template_kwargs=kwargs or {})
    assert inputs.prepare(prompt, SamplingParams()).reasoning is start
    off = InputProcessor(tokenizer, 49152, 2048, eos_token_ids=[2], reasoning_parser="none")
    assert off.prepare(prompt, SamplingParams()).reasoning is None
    plain = InputProcessor(smollm2_tokenizer, 49152, 2048, eos_token_ids=[2])  # no <think> in its template
    assert not plain.splits_reasoning and plain.prepare(prompt, SamplingParams()).reasoning is None


def test_the_tags_are_read_off_the_template_or_named_by_the_parser() -> None:
    assert template_reasoning_tags("{{ '<seed:think>' + reasoning + '</seed:think>' }}") == SEED_THINK
    assert template_reasoning_tags("{{ '[THINK]' + thinking + '[/THINK]' }}") == MISTRAL_THINK
    assert template_reasoning_tags(QWEN3_LIKE) == THINK and template_reasoning_tags("{{ messages }}") is None
    gemma4 = "{%- if not enable_thinking | default(false) -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}"
    assert template_reasoning_tags(gemma4) == GEMMA4_THINK
    assert reasoning_start("<|turn>model\n<|channel>thought\n<channel|>", GEMMA4_THINK) is None  # thinking off
    assert reasoning_start("<|turn>model\n", GEMMA4_THINK) is IF_OPENED
    assert parser_reasoning_tags("seed_oss", "") == SEED_THINK
    assert parser_reasoning_tags("mistral", QWEN3_LIKE) == MISTRAL_THINK  # a named parser wins over the template
    assert parser_reasoning_tags("auto", R1_LIKE) == THINK
    for parser in ("none", "openai_gptoss"):
        assert parser_reasoning_tags(parser, QWEN3_LIKE) is None
    named = set(REASONING_PARSERS) - {"auto", "none", "openai_gptoss"}
    assert all(parser_reasoning_tags(p, "") is not None for p in named)  # every other name names a pair


MAGISTRAL_LIKE = (
    "{%- for m in messages %}[INST]{{ m.content }}[/INST]{%- endfor %}"
    "{#- a reply thinks first: [THINK]...[/THINK] #}"
)


def test_tags_that_are_special_tokens_keep_the_special_tokens_in_the_text(smollm2_tokenizer: Any) -> None:
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = MAGISTRAL_LIKE
    prompt = ChatPrompt([ChatMessage("user", "What is 2 + 2?")])
    plain = InputProcessor(tokenizer, 49152, 2048, eos_token_ids=[2]).prepare(prompt, SamplingParams())
    assert plain.reasoning is IF_OPENED and plain.reasoning_tags == MISTRAL_THINK
    assert plain.params.skip_special_tokens  # text tags: nothing to keep
    tokenizer.add_special_tokens({"additional_special_tokens": ["[THINK]", "[/THINK]"]})
    special = InputProcessor(tokenizer, 49152, 2048, eos_token_ids=[2]).prepare(prompt, SamplingParams())
    assert special.reasoning is IF_OPENED and not special.params.skip_special_tokens
    ids = tokenizer.encode("[THINK]2 and 2.[/THINK]4", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == "[THINK]2 and 2.[/THINK]4"  # what the split reads


COHERE_REPLY = "<|START_THINKING|>Add them.<|END_THINKING|><|START_RESPONSE|>It is 4.<|END_RESPONSE|>"


@pytest.mark.parametrize("text", [COHERE_REPLY, "<|START_RESPONSE|>It is 4.<|END_RESPONSE|>"])
def test_cohere_answer_markers_are_dropped_from_the_content_however_the_text_is_cut(text: str) -> None:
    whole = _split(text, IF_OPENED, [], COHERE_THINK)
    assert whole == ("Add them." if "THINKING" in text else "", "It is 4.")
    for cut in range(1, len(text)):
        assert _split(text, IF_OPENED, [cut], COHERE_THINK) == whole, cut
    assert template_reasoning_tags("0. Start by writing <|START_THINKING|> followed by a plan") == COHERE_THINK


def test_a_marker_filter_holds_a_partial_marker_and_gives_back_one_that_never_completes() -> None:
    markers = MarkerFilter(["<|END_RESPONSE|>"])
    assert markers.feed("It is 4.<|END_") == "It is 4."
    assert markers.feed("RESPONSE|>") == ""
    assert markers.feed("a <|END") == "a "
    assert markers.finish() == "<|END"  # the end came first: it was text
