"""Each token's own bytes and text, for logprobs (OpenAI's `token` and `bytes` fields).

A byte-level BPE token may hold part of a UTF-8 character (one emoji spans several tokens), so a token's
bytes are the ground truth and its text is derived from them: valid UTF-8 decodes as itself, and bytes that
are not valid on their own appear as `\\xNN` escapes (Python's "backslashreplace"), a stable form that never
contains U+FFFD. Special and added tokens are their content, e.g. "<|im_end|>".
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL_CHAR_TO_BYTE: Mapping[str, int] = MappingProxyType(_byte_level_alphabet())
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTextCodec:
    """Maps token ids to their bytes and display text for one tokenizer. Build once, reuse freely.

    Supported decoders: ByteLevel (exact), SentencePiece-style (ByteFallback `<0xNN>` tokens, Metaspace
    or Replace of "▁" by " "; exact). Any other decoder falls back to decoding the token on its own.
    Ids the tokenizer does not know (padding rows of a larger embedding) map to b"".
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        decoders = _decoder_specs(backend)
        kinds = {d.get("type") for d in decoders}
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        self._replacements = _replacements(decoders)
        self._sentencepiece = self._byte_fallback or bool(self._replacements)
        added = backend.get_added_tokens_decoder() if backend is not None else tokenizer.added_tokens_decoder
        # Seeded with added tokens: their bytes are their content, whatever the decoder would do.
        self._cache: dict[int, bytes] = {i: tok.content.encode("utf-8") for i, tok in added.items()}

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """The UTF-8 bytes each token contributes to decoded text (before any leading-space stripping)."""
        return [self._bytes_of(i) for i in ids]

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text; bytes that are not valid UTF-8 on their own appear as `\\xNN` escapes."""
        return [self._bytes_of(i).decode("utf-8", errors="backslashreplace") for i in ids]

    def _bytes_of(self, token_id: int) -> bytes:
        # Bounded by the vocabulary; logprobs revisit the same frequent tokens constantly.
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute_bytes(token_id)
        return cached

    def _compute_bytes(self, token_id: int) -> bytes:
        piece = self._piece(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            if all(c in _BYTE_LEVEL_CHAR_TO_BYTE for c in piece):
                return bytes(_BYTE_LEVEL_CHAR_TO_BYTE[c] for c in piece)
            return piece.encode("utf-8")  # a vocabulary entry outside the byte alphabet is literal text
        if self._sentencepiece:
            fallback = _BYTE_FALLBACK_TOKEN.fullmatch(piece) if self._byte_fallback else None
            if fallback is not None:
                return bytes([int(fallback.group(1), 16)])
            for old, new in self._replacements:
                piece = piece.replace(old, new)
            return piece.encode("utf-8")
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        assert isinstance(text, str)
        return text.encode("utf-8")

    def _piece(self, token_id: int) -> str | None:
        if self._backend is not None:
            piece = self._backend.id_to_token(token_id)
        else:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
        return piece if isinstance(piece, str) else None


def _decoder_specs(backend: Any) -> list[dict[str, Any]]:
    """The decoder's steps as JSON dicts (a Sequence flattened); [] without a Rust tokenizer."""
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return []
    spec = json.loads(decoder.__getstate__())
    return list(spec.get("decoders", [spec])) if spec.get("type") == "Sequence" else [spec]


def _replacements(decoders: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(old, new) string replacements a SentencePiece-style decoder applies to each token."""
    found: list[tuple[str, str]] = []
    for d in decoders:
        if d.get("type") == "Metaspace":
            found.append((d.get("replacement", "▁"), " "))
        elif d.get("type") == "Replace" and "String" in d.get("pattern", {}):
            found.append((d["pattern"]["String"], d.get("content", "")))
    return found


def token_bytes(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[bytes]:
    """Each token's bytes (OpenAI's logprob `bytes` field). Hot paths should keep a `TokenTextCodec`."""
    return TokenTextCodec(tokenizer).token_bytes(ids)


def token_strings(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[str]:
    """Each token's own text (OpenAI's logprob `token` field); see the module docstring for the form."""
    return TokenTextCodec(tokenizer).token_strings(ids)
