"""gpt-oss's output read as OpenAI's harmony format: reasoning, content and tool calls apart.

A gpt-oss reply (after the generation prompt's `<|start|>assistant`) is a sequence of messages, each a header, then
`<|message|>`, its body, and an end:

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city": "Rome"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

A header names the message's channel (`<|channel|>NAME`) and may name a recipient (` to=functions.NAME`, before or
after the channel) and a content type (`<|constrain|>json`, or a bare word after the channel). A message ends with
`<|end|>` (more follow), `<|call|>` (a tool call: the output stops) or `<|return|>` (the answer: the output stops);
the last two are end-of-sequence tokens, so the text ends before them. How each message is read:
- to a recipient `functions.NAME` (when the request's tools are read): a tool call of NAME with the body as its
  JSON arguments, released whole once its end (or the output's) is seen;
- `analysis` (or another recipient): reasoning;
- `final`, `commentary` without a recipient (a preamble) and anything else: content.
The markers themselves are in no part. Text that does not open with a header (a model that does not write harmony,
or output constrained to an answer) is content as written. `HarmonyStream` reads a choice's text as it arrives
under the stream contract of the reasoning and tool parsers: what it releases does not depend on how the text was
split; a partial marker is held back. The text must be decoded with the special tokens kept (the markers are
special tokens).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from engine_server.tools.parsers import partial_suffix_len

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_ENDS = (END, CALL, RETURN, START)  # a body ends at these (a new `<|start|>` if the model skipped `<|end|>`)
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_][\w-]*)")


@dataclass(frozen=True)
class HarmonyCall:
    """A tool call read from a message to `functions.NAME`: the name and the body (its JSON arguments)."""

    name: str
    arguments: str


@dataclass
class HarmonyDelta:
    """What one piece of text released: reasoning, content, and calls now complete."""

    reasoning: str = ""
    content: str = ""
    calls: list[HarmonyCall] = field(default_factory=list)

    def extend(self, other: HarmonyDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls


class _Sink(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    CALL = "call"


class HarmonyStream:
    """One choice's harmony text split as it arrives (module doc). `reads_calls`: messages to `functions.NAME` are
    tool calls (the request has tools to call); otherwise they are reasoning."""

    def __init__(self, reads_calls: bool) -> None:
        self.reads_calls = reads_calls
        self._held = ""
        self._in_header = True  # the reply starts with a message's header
        self._seen_header = False  # a header was read: text that does not open with one is plain content
        self._sink = _Sink.CONTENT
        self._call_name = ""
        self._call_body = ""
        self.reasoning_end = 0  # characters of the text up to the end of its last reasoning message
        self._consumed = 0  # characters of the text taken out of `_held`

    def feed(self, text: str) -> HarmonyDelta:
        """What `text` (the next piece of the choice's text) releases."""
        self._held += text
        delta = HarmonyDelta()
        while self._held:
            if self._in_header:
                if not self._read_header():
                    break
            elif not self._read_body(delta, final=False):
                break
        return delta

    def finish(self) -> HarmonyDelta:
        """What is still held at the end of the output: a body's text as written (a cut-off marker included) and a
        call whose end never came; a header cut off is dropped."""
        delta = HarmonyDelta()
        if not self._in_header:
            self._read_body(delta, final=True)
        elif not self._seen_header:
            delta.content += self._held  # text that could still have opened a header, but never did
        self._held = ""
        return delta

    def _take(self, count: int) -> str:
        taken, self._held = self._held[:count], self._held[count:]
        self._consumed += count
        return taken

    def _read_header(self) -> bool:
        """Read a header up to `<|message|>` and choose the body's sink; False when more text is needed."""
        if not self._seen_header:
            head = self._held.lstrip()
            if not any(head.startswith(m) or m.startswith(head) for m in (CHANNEL, START)):
                self._in_header, self._sink = False, _Sink.CONTENT  # not harmony: content as written
                return True
            if not any(head.startswith(m) for m in (CHANNEL, START)):
                return False  # a marker's first characters: wait
        end = self._held.find(MESSAGE)
        if end < 0:
            return False
        header = self._take(end)
        self._take(len(MESSAGE))
        self._seen_header = True
        self._in_header = False
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        to = recipient.group(1) if recipient else ""
        if to.startswith(FUNCTIONS) and self.reads_calls:
            self._sink, self._call_name, self._call_body = _Sink.CALL, to[len(FUNCTIONS) :], ""
        elif to or (channel is not None and channel.group(1) == "analysis"):
            self._sink = _Sink.REASONING
        else:
            self._sink = _Sink.CONTENT
        return True

    def _read_body(self, delta: HarmonyDelta, final: bool) -> bool:
        """Release a body's text up to its end marker; False when more text is needed. With `final` the held text
        is the body's last."""
        ends = [(at, marker) for marker in _ENDS if (at := self._held.find(marker)) >= 0]
        if ends:
            at, marker = min(ends)
            self._release(self._take(at), delta)
            if marker != START:
                self._take(len(marker))
            self._end_message(delta)
            return True
        keep = 0 if final else max(partial_suffix_len(self._held, marker) for marker in _ENDS)
        self._release(self._take(len(self._held) - keep), delta)
        if final:
            self._end_message(delta)
        return False

    def _release(self, text: str, delta: HarmonyDelta) -> None:
        if self._sink is _Sink.CALL:
            self._call_body += text
        elif self._sink is _Sink.REASONING:
            delta.reasoning += text
        else:
            delta.content += text

    def _end_message(self, delta: HarmonyDelta) -> None:
        if self._sink is _Sink.CALL:
            delta.calls.append(HarmonyCall(self._call_name, self._call_body.strip()))
        elif self._sink is _Sink.REASONING:
            self.reasoning_end = self._consumed
        self._in_header = True
