"""Reasoning split from the answer: a thinking model's `<think>…</think>` (Qwen3, DeepSeek-R1, QwQ, GLM-4.5,
MiniMax-M2, Kimi K2), Seed-OSS's `<seed:think>…</seed:think>`, Magistral's `[THINK]…[/THINK]`, Cohere's plan or Gemma
4's thought channel (`ReasoningTags`) apart
from its content, as vLLM's, SGLang's and llama.cpp's servers return it (`reasoning_content`). Which tags a model
writes is read off its chat template (`template_reasoning_tags`: the first pair whose opening tag it mentions) or
named by the reasoning parser (`parser_reasoning_tags`).

Where the reasoning starts is read off the rendered prompt (`reasoning_start`; `<think>` and `</think>` stand for
the family's tags here):
- the prompt ends inside a `<think>` it opened (R1-style templates open it in the generation prompt): the output
  is reasoning from its first character, up to `</think>`;
- the prompt ends with a closed `<think>…</think>` (Qwen3's template with `enable_thinking: false` writes an empty
  one): no reasoning is expected and nothing is split;
- otherwise the output is reasoning only when it opens with `<think>` itself (after any whitespace).
`ReasoningStream` applies that to one choice's text as it arrives, under the tool parsers' contract: what it
releases does not depend on how the text was split, a partial tag is held back (never shown and taken back), and
an output cut inside its reasoning (max_tokens) has reasoning and no content. The tags themselves are in neither
part; the whitespace between `</think>` and the answer is dropped.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine_server.tools.parsers import partial_suffix_len

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningTags:
    """The tags a family writes its reasoning between, and the markers it wraps its answer in (`answer`: opening,
    closing), which are dropped from the content (Cohere's `<|START_RESPONSE|>` ... `<|END_RESPONSE|>`)."""

    open: str
    close: str
    answer: tuple[str, str] | None = None


THINK = ReasoningTags(THINK_OPEN, THINK_CLOSE)
SEED_THINK = ReasoningTags("<seed:think>", "</seed:think>")  # Seed-OSS
MISTRAL_THINK = ReasoningTags("[THINK]", "[/THINK]")  # Magistral (its tags are special tokens of its vocabulary)
# Command R7B / Command A: a plan, then actions or the answer in its markers (special tokens, as the tags).
COHERE_THINK = ReasoningTags("<|START_THINKING|>", "<|END_THINKING|>", ("<|START_RESPONSE|>", "<|END_RESPONSE|>"))
# Gemma 4: its thought channel (with thinking off its template closes an empty one in the prompt).
GEMMA4_THINK = ReasoningTags("<|channel>thought", "<channel|>")
_DETECTED = (SEED_THINK, MISTRAL_THINK, COHERE_THINK, GEMMA4_THINK, THINK)
# The reasoning parser names (vLLM's) that name a pair; "auto" reads it off the template, "none" splits nothing.
_NAMED = {"qwen3": THINK, "deepseek_r1": THINK, "glm45": THINK, "kimi_k2": THINK, "minimax_m2": THINK,
          "seed_oss": SEED_THINK, "mistral": MISTRAL_THINK, "cohere": COHERE_THINK, "gemma4": GEMMA4_THINK}  # fmt: skip


def template_reasoning_tags(template_text: str) -> ReasoningTags | None:
    """The tags of the first known pair whose opening tag `template_text` (a chat template) mentions, or None."""
    return next((tags for tags in _DETECTED if tags.open in template_text), None)


def parser_reasoning_tags(parser: str, template_text: str) -> ReasoningTags | None:
    """The tags a reasoning parser name (`EngineConfig.reasoning_parser`) splits on: "auto" those the template
    implies (None when it implies none), a family's name its pair, anything else (none, openai_gptoss) None."""
    if parser == "auto":
        return template_reasoning_tags(template_text)
    return _NAMED.get(parser)


def shortest_prefix(token_ids: Sequence[int], holds: Callable[[Sequence[int]], bool]) -> int:
    """The fewest leading tokens of `token_ids` for which `holds` is true (a binary search: `holds` must stay true
    for every longer prefix); `len(token_ids)` when only the whole holds, or nothing does."""
    low, high = 0, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if holds(token_ids[:middle]):
            high = middle
        else:
            low = middle + 1
    return low


class ReasoningStart(enum.Enum):
    """Where a choice's reasoning starts (see the module docstring)."""

    INSIDE = "inside"  # the prompt opened <think>: the output starts in the reasoning
    IF_OPENED = "if_opened"  # the output is reasoning if it opens with <think>


def reasoning_start(prompt_text: str, tags: ReasoningTags = THINK) -> ReasoningStart | None:
    """How a choice of a prompt rendered as `prompt_text` is split; None: it is not (the prompt closed the
    reasoning itself)."""
    opened, closed = prompt_text.rfind(tags.open), prompt_text.rfind(tags.close)
    if opened > closed and not prompt_text[opened + len(tags.open) :].strip():
        return ReasoningStart.INSIDE
    if closed >= 0 and not prompt_text[closed + len(tags.close) :].strip():
        return None
    return ReasoningStart.IF_OPENED


class _State(enum.Enum):
    OPENING = "opening"  # the output may still open with <think>
    REASONING = "reasoning"
    ANSWER_START = "answer_start"  # after </think>: leading whitespace is dropped
    CONTENT = "content"


class ReasoningStream:
    """One choice's text split into reasoning and content as it arrives (see the module docstring)."""

    def __init__(self, start: ReasoningStart, tags: ReasoningTags = THINK) -> None:
        self.tags = tags
        self._state = _State.REASONING if start is ReasoningStart.INSIDE else _State.OPENING
        self._held = ""
        self._answer = MarkerFilter(tags.answer or ())
        self.entered = self._state is _State.REASONING  # the output has (had) a reasoning

    def reasoning_tokens(self, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> int:
        """How many of the finished output's `token_ids` make its reasoning: none without one, all of them when
        the output ended inside it, else those up to the one that completes `</think>` (found by `decode`-ing
        prefixes: a token's text may hold part of a tag, or several tags)."""
        if not self.entered:
            return 0
        if self._state is _State.REASONING:
            return len(token_ids)
        return shortest_prefix(token_ids, lambda prefix: self.tags.close in decode(prefix))

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ended inside the reasoning (not merely before an opening tag may come)."""
        return self._state is _State.REASONING

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) released by `text`."""
        reasoning, content = self._split(text)
        return reasoning, self._answer.feed(content)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held at the end of the output."""
        reasoning, content = self._split_rest()
        return reasoning, self._answer.feed(content) + self._answer.finish()

    def _split(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning, content = "", ""
        while self._held:
            if self._state is _State.OPENING:
                head = self._held.lstrip()
                if head.startswith(self.tags.open):
                    self._held = head[len(self.tags.open) :]
                    self._state = _State.REASONING
                    self.entered = True
                elif self.tags.open.startswith(head):  # whitespace, or a partial tag: wait
                    break
                else:
                    self._state = _State.CONTENT
            elif self._state is _State.REASONING:
                end = self._held.find(self.tags.close)
                if end < 0:
                    keep = partial_suffix_len(self._held, self.tags.close)
                    reasoning += self._held[: len(self._held) - keep]
                    self._held = self._held[len(self._held) - keep :]
                    break
                reasoning += self._held[:end]
                self._held = self._held[end + len(self.tags.close) :]
                self._state = _State.ANSWER_START
            elif self._state is _State.ANSWER_START:
                self._held = self._held.lstrip()
                if self._held:
                    self._state = _State.CONTENT
            else:
                content += self._held
                self._held = ""
        return reasoning, content

    def _split_rest(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state is _State.REASONING:
            return held, ""  # a partial closing tag at the very end: part of the reasoning as written
        if self._state is _State.OPENING:
            self._state = _State.CONTENT
            return "", held  # whitespace, or the start of a tag that never came
        return "", "" if self._state is _State.ANSWER_START else held


class MarkerFilter:
    """Drops every occurrence of `markers` from a text that arrives in pieces: a piece's end that may be the start
    of a marker is held until the next piece (or `finish`) shows whether it is one."""

    def __init__(self, markers: Sequence[str]) -> None:
        self.markers = tuple(markers)
        self._held = ""

    def feed(self, text: str) -> str:
        if not self.markers:
            return text
        text = self._held + text
        for marker in self.markers:
            text = text.replace(marker, "")
        keep = max((partial_suffix_len(text, marker) for marker in self.markers), default=0)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def finish(self) -> str:
        held, self._held = self._held, ""
        return held
