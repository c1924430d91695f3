"""Incremental detokenization: token ids in, newly stable text out, a bounded window decoded per step.

Contract: for a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, SmolLM2) and a prompt that ends on a
character boundary, the concatenation of every `add` result and the final `flush` equals
`tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`. No delta ever
ends inside a multi-byte character: text whose decoded tail is U+FFFD (an incomplete UTF-8 sequence) is
held back until a later token completes it, or until `flush`.

For SentencePiece-style decoders (Metaspace, `Strip`), the last prompt tokens are decoded ahead of the
output as context, so the first output token keeps its leading space (" Paris" after "The capital is"),
which a stand-alone decode of the output would drop. This is deliberate: the text continues the prompt.
Tokenizer clean-up of spaces before punctuation is never applied; it is a WordPiece heuristic that would
make earlier deltas wrong after the fact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded in front of the output. A few are enough for any decoder we know to place the
# first output token's leading space and merges as a full decode would.
_PROMPT_CONTEXT_TOKENS = 5

Decode = Callable[[list[int]], str]


def make_decode(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Decode:
    """A `list[int] -> str` decode without clean-up; the Rust tokenizer directly when there is one.

    Calling `tokenizers.Tokenizer.decode` skips transformers' Python wrapper, about 4x faster on the
    short windows decoded here.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return partial(backend.decode, skip_special_tokens=skip_special_tokens)

    def decode(ids: list[int]) -> str:
        text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
        assert isinstance(text, str)
        return text

    return decode


def is_context_free(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether decoding is per-token bytes then UTF-8 (ByteLevel): text of a concatenation that splits on a
    character boundary is then the concatenation of the texts, with no leading-space rules."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and type(decoder).__name__ == "ByteLevel"


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text deltas as they arrive.

    Each step decodes only a window: the tokens of the last emitted delta (the "prefix", whose text is
    cached) plus the tokens not yet emitted. Because the prefix starts and ends on character boundaries,
    the window's text starts with the prefix text, and the rest is the new delta. While every delta is
    valid UTF-8 the window stays a few tokens long, so a step costs O(1); a long run of invalid bytes
    grows it until a valid character or `flush` ends the run.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        silent_from: int | None = None,
    ) -> None:
        """`silent_from`: ids from it up give no text and split it (Whisper's timestamp tokens, which transformers'
        `decode` filters out: `_add_around_silent`); None: every id is text."""
        self._decode = make_decode(tokenizer, skip_special_tokens)
        self._silent_from = silent_from
        self._context_free = is_context_free(tokenizer)
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context) if context else ""
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character; output bytes completing it would rewrite the
            # context's text. Decode the output on its own instead, as a full decode of it would.
            context, context_text = [], ""
        self._window: list[int] = context  # prefix tokens, then tokens not yet emitted
        self._read_offset = len(context)  # window[:read_offset] is the prefix
        self._prefix_text = context_text  # decode(window[:read_offset])

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Appends tokens; returns the text that became stable (possibly "")."""
        if self._silent_from is not None and any(token >= self._silent_from for token in new_token_ids):
            return self._add_around_silent(new_token_ids)
        if not new_token_ids:
            return ""
        self._window.extend(new_token_ids)
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            # Nothing visible yet (a skipped special token) or a character is still incomplete.
            return ""
        return self._emit(text)

    def _add_around_silent(self, new_token_ids: Sequence[int]) -> str:
        """`add` for tokens some of which are silent: each silent token gives no text and ends the run of tokens
        before it (its held-back bytes flushed), so the runs decode apart, as a full decode with the silent tokens
        as added tokens then filtered out of the text would have them (transformers' Whisper `decode`)."""
        assert self._silent_from is not None
        text, run = "", list[int]()
        for token in new_token_ids:
            if token < self._silent_from:
                run.append(token)
                continue
            text += self.add(run) + self.flush()
            run = []
            self._window, self._read_offset, self._prefix_text = [], 0, ""
        return text + self.add(run)

    def flush(self) -> str:
        """Returns all held-back text, incomplete characters included (as U+FFFD). Call once at finish."""
        if len(self._window) == self._read_offset:
            return ""
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text):
            self._read_offset = len(self._window)
            return ""
        return self._emit(text)

    def _emit(self, text: str) -> str:
        delta = text[len(self._prefix_text) :]
        # The tokens just emitted become the next prefix: they start and end on character boundaries.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        # A context-free decoder gives the emitted tokens exactly the delta's text: skip one decode per step.
        self._prefix_text = delta if self._context_free else self._decode(self._window)
        return delta
