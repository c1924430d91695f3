"""Tool-call parsers: a choice's text in (as stream deltas), content and complete calls out. Here the contract, the
Hermes and the Llama 3 JSON parsers; `call_formats` has the other formats' and `make_parser`.

Contract of every parser, whatever the format:
- `feed(delta)` returns the content that is safe to show now and the calls completed by this delta;
  `finish()` returns the rest. Text that could still turn into a call (a partial opening tag, a call whose
  closing tag has not come) is held back, like a partial stop string, never shown and then taken back.
- The result does not depend on how the text was split: feeding it in any pieces and then calling `finish`
  gives the same content (joined) and calls as feeding it at once.
- A call is kept only when its JSON parses, names a known function (when names are given) and its arguments
  are a JSON object; anything else is left in the content exactly as the model wrote it.
- Whitespace before a call, between calls, and around content that only calls precede or follow is dropped
  ("Checking.\n<call>\nDone." → "Checking.\nDone."); output without calls is returned unchanged.
Arguments come back re-serialized with `json.dumps` (", " and ": " separators, key order kept).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
# What reading a model's JSON may raise: malformed text, or nesting deeper than the decoder recurses (a model can
# write "[[[[..." for as long as max_tokens lets it); either way the text is not a call.
JSON_ERRORS = (json.JSONDecodeError, RecursionError)
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ParsedCall:
    """A call found in the output: the function's name and its arguments as JSON object text; `call_id` is the id the
    model wrote for it in formats that carry one (Kimi K2's `functions.NAME:N`), else empty (a fresh id is made)."""

    name: str
    arguments_json: str
    call_id: str = ""


@dataclass
class ParseStep:
    """What one `feed` or `finish` released: content to show, and calls completed, in output order."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def extend(self, other: ParseStep) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


class ToolCallParser(ABC):
    """One choice's parser; see the module docstring for the contract."""

    def __init__(self, names: Iterable[str] | None = None) -> None:
        """`names`: the functions a call may name (None accepts any name)."""
        self.names = frozenset(names) if names is not None else None

    @abstractmethod
    def feed(self, text: str) -> ParseStep: ...

    @abstractmethod
    def finish(self) -> ParseStep: ...

    def call_from(self, obj: Any) -> ParsedCall | None:
        """A call from a decoded JSON value `{"name": ..., "arguments" | "parameters": {...}}`, else None."""
        if not isinstance(obj, dict):
            return None
        name = obj.get("name")
        if not isinstance(name, str) or not name or (self.names is not None and name not in self.names):
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):  # some models send the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except JSON_ERRORS:
                return None
        if not isinstance(arguments, dict):
            return None
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the output, any number.

    A closing tag counts only outside JSON strings (an argument may contain "</tool_call>"). A block the output
    ends inside (no closing tag) is still a call when its JSON is complete.

    Other block formats subclass it: their tags (`open_tag`, `close_tag`), whether the body is JSON whose strings
    the closing tag is looked for outside of (`json_body`; formats of raw-text values or whose closing tag is a
    marker token look for its first occurrence), and what calls a block's body holds (`calls_of`, one or more;
    `call_of` where a block holds one call).
    """

    open_tag: ClassVar[str] = HERMES_OPEN
    close_tag: ClassVar[str] = HERMES_CLOSE
    json_body: ClassVar[bool] = True

    def __init__(self, names: Iterable[str] | None = None) -> None:
        super().__init__(names)
        self._pending = ""  # outside a call: text not yet released (held whitespace, a partial opening tag)
        self._body: str | None = None  # inside a call: the text after its opening tag
        self._gap = ""  # whitespace dropped before the open call, given back if the call is malformed
        self._after_call = False  # drop leading whitespace: a call came before any content
        self._made_calls = False
        self._released = False  # some content was released
        self._scan = _JsonStringScanner()

    def feed(self, text: str) -> ParseStep:
        step = ParseStep()
        if self._body is None:
            self._pending += text
        else:
            self._body += text
        self._advance(step, final=False)
        return step

    def finish(self) -> ParseStep:
        step = ParseStep()
        self._advance(step, final=True)
        if self._body is not None:
            self._close(self._body, step, closed=False)
            self._advance(step, final=True)
        return step

    def _advance(self, step: ParseStep, final: bool) -> None:
        while True:
            if self._body is not None:
                end = self.find_close(self._body)
                if end < 0:
                    return
                rest = self._body[end + len(self.close_tag) :]
                self._close(self._body[:end], step, closed=True)
                self._pending = rest
                continue
            if self._after_call:
                self._pending = self._pending.lstrip()
                if not self._pending:
                    return
                self._after_call = False
            start = self._pending.find(self.open_tag)
            if start < 0:
                self._release(step, final)
                return
            before = self._pending[:start]
            content = before.rstrip()
            self._emit(step, content)
            self._gap = before[len(content) :]
            self._body = self._pending[start + len(self.open_tag) :]
            self._pending = ""

    def _release(self, step: ParseStep, final: bool) -> None:
        """Release pending text outside calls, holding a partial opening tag and trailing whitespace."""
        text = self._pending
        if final:
            self._emit(step, text.rstrip() if self._made_calls else text)
            self._pending = ""
            return
        emit = text[: len(text) - partial_suffix_len(text, self.open_tag)].rstrip()
        self._emit(step, emit)
        self._pending = text[len(emit) :]

    def _emit(self, step: ParseStep, text: str) -> None:
        step.content += text
        self._released = self._released or bool(text)

    def find_close(self, body: str) -> int:
        """Where the open call's closing tag starts in `body` (which only grows while the call is open), or -1."""
        if not self.json_body:
            return body.find(self.close_tag)
        return self._scan.find_outside_strings(body, self.close_tag)

    def calls_of(self, body: str) -> list[ParsedCall]:
        """The calls a block's body holds, or [] when any part of it is not a call."""
        call = self.call_of(body)
        return [] if call is None else [call]

    def call_of(self, body: str) -> ParsedCall | None:
        """The call a block's body holds, or None when it holds none."""
        try:
            return self.call_from(json.loads(body))
        except JSON_ERRORS:
            return None

    def _close(self, body: str, step: ParseStep, closed: bool) -> None:
        calls = self.calls_of(body)
        if not calls:
            self._emit(step, self._gap + self.open_tag + body + (self.close_tag if closed else ""))
        else:
            step.calls.extend(calls)
            self._made_calls = True
            self._after_call = not self._released
        self._gap, self._body = "", None
        self._scan = _JsonStringScanner()


class _JsonStringScanner:
    """Finds a marker outside JSON strings in a growing text, scanning each character once."""

    def __init__(self) -> None:
        self._pos = 0
        self._in_string = False
        self._escaped = False

    def find_outside_strings(self, text: str, marker: str) -> int:
        """Where `marker` first starts outside a string in `text` (which only ever grows), or -1."""
        while self._pos < len(text):
            char = text[self._pos]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif text.startswith(marker, self._pos):
                return self._pos
            elif marker.startswith(text[self._pos :]):
                return -1  # a partial marker at the end: look again once more text came
            self._pos += 1
        return -1


class WholeOutputParser(ToolCallParser):
    """Formats whose calls are the whole output: output that starts like calls (`may_be_calls`) is held until the
    end and then parsed (`parse`); any other streams at once."""

    def __init__(self, names: Iterable[str] | None = None) -> None:
        super().__init__(names)
        self._held = ""
        self._holding = True

    @abstractmethod
    def may_be_calls(self, text: str) -> bool:
        """Whether the output so far, `text`, may still turn out to be calls."""

    @abstractmethod
    def parse(self, text: str) -> list[ParsedCall]:
        """Every call of a held output, or [] when any part of it is not a call."""

    def feed(self, text: str) -> ParseStep:
        if not self._holding:
            return ParseStep(text)
        self._held += text
        if self.may_be_calls(self._held):
            return ParseStep()
        self._holding = False
        text, self._held = self._held, ""
        return ParseStep(text)

    def finish(self) -> ParseStep:
        text, self._held = self._held, ""
        if not self._holding:
            return ParseStep()
        self._holding = False
        calls = self.parse(text)
        return ParseStep(calls=calls) if calls else ParseStep(text)


class Llama3JsonParser(WholeOutputParser):
    """Llama 3 JSON calls: the whole output is `{"name": ..., "parameters": {...}}` (or several, separated by
    ";"), optionally after `<|python_tag|>`."""

    def may_be_calls(self, text: str) -> bool:
        head = text.lstrip()
        return head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head)

    def parse(self, text: str) -> list[ParsedCall]:
        """Every call of a held output, or [] when any part of it is not a call."""
        body = text.strip().removeprefix(PYTHON_TAG)
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            pos = _skip_space(body, pos)
            if pos == len(body):
                return calls
            if calls:
                if body[pos] != ";":
                    return []
                pos = _skip_space(body, pos + 1)
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except JSON_ERRORS:
                return []
            call = self.call_from(obj)
            if call is None:
                return []
            calls.append(call)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def partial_suffix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
