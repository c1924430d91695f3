"""Incremental detokenization and logprob token text against a full decode."""

from __future__ import annotations

import random
from typing import Any, cast

import pytest

from engine_server.output.detokenizer import IncrementalDetokenizer
from engine_server.output.token_text import TokenTextCodec, token_bytes, token_strings

TEXTS = [
    "Hello, world!\n\nNew paragraph.",
    "你好，世界。再见！",
    "emoji 😀🎉 and a family 👨‍👩‍👧 and a flag 🇫🇷",
    "mixed: café naïve Ελληνικά русский 日本語 한국어 ✓ ∑ ∞",
    "e\u0301 combining, \u200b zero width, tab\tend",
    "<|im_end|> literal special text",
]
POOL = ["a", " ", "\n", "。", "你", "好", "😀", "🎉", "é", "∑", "👨‍👩‍👧", "ab", "  ", "x", "世界"]


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None) -> list[str]:
    """Feeds ids one at a time (or in random chunks of 1-4) and returns every delta, the flush last."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4) if rng else 1
        deltas.append(detok.add(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


def random_valid_text(rng: random.Random) -> str:
    return "".join(rng.choice(POOL) for _ in range(rng.randint(1, 40)))


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode_and_never_split_characters(smollm2_tokenizer: Any, text: str) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode(text)
    deltas = stream(IncrementalDetokenizer(tok, [], skip_special_tokens=False), ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=False) == text
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_characters_are_held_until_complete(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("😀")
    assert len(ids) > 1  # byte-level BPE splits the emoji
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"))
    assert [detok.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["😀"]
    assert detok.flush() == ""


def test_flush_releases_an_incomplete_character_as_replacement(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    partial = tok.encode("hi 😀")[:-1]
    detok = IncrementalDetokenizer(tok, [])
    text = "".join(detok.add([i]) for i in partial)
    assert text == "hi"  # " " and the emoji's first byte share a token
    tail = detok.flush()
    assert tail.endswith("\ufffd")
    assert text + tail == tok.decode(partial)


@pytest.mark.parametrize("seed", range(30))
def test_random_valid_text_in_random_chunks(smollm2_tokenizer: Any, seed: int) -> None:
    tok = smollm2_tokenizer
    rng = random.Random(seed)
    prompt = tok.encode(random_valid_text(rng))
    text = random_valid_text(rng)
    ids = tok.encode(text)
    deltas = stream(IncrementalDetokenizer(tok, prompt), ids, rng)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(25))
def test_random_token_ids_match_full_decode(smollm2_tokenizer: Any, seed: int, skip_special_tokens: bool) -> None:
    """Arbitrary ids (invalid byte runs and special tokens included) still concatenate to the full decode."""
    tok = smollm2_tokenizer
    rng = random.Random(seed)
    special = tok.all_special_ids
    ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(60)]
    prompt = tok.encode("prompt text")
    deltas = stream(IncrementalDetokenizer(tok, prompt, skip_special_tokens), ids, rng)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_special_tokens_skipped_or_kept(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = [*tok.encode("a"), 2, *tok.encode(" b")]  # 2 is <|im_end|>
    assert "".join(stream(IncrementalDetokenizer(tok, [], True), ids)) == "a b"
    assert "".join(stream(IncrementalDetokenizer(tok, [], False), ids)) == "a<|im_end|> b"


def test_prompt_ending_inside_a_character_decodes_output_alone(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("好😀")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    prompt, output = ids[:cut], ids[cut:]  # the prompt ends inside a character
    assert "".join(stream(IncrementalDetokenizer(tok, prompt), output)) == tok.decode(output)


class DecodeSpy:
    """A tokenizer without a Rust backend that records how many ids each decode call sees."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.window_sizes.append(len(ids))
        return str(self._tokenizer.decode(ids, **kwargs))


def test_each_step_decodes_a_small_window(smollm2_tokenizer: Any) -> None:
    text = " ".join(TEXTS) * 10
    spy = DecodeSpy(smollm2_tokenizer)
    ids = smollm2_tokenizer.encode(text)
    assert len(ids) > 500
    detok = IncrementalDetokenizer(cast(Any, spy), smollm2_tokenizer.encode("a long prompt " * 50), False)
    deltas = stream(detok, ids)
    assert "".join(deltas) == text
    assert max(spy.window_sizes) <= 8  # bounded by the longest character's token count, not the output
    assert len(spy.window_sizes) <= 2 * len(ids) + 2


def sentencepiece_tokenizer() -> Any:
    """A tiny Llama-2-style tokenizer: '▁' for spaces, <0xNN> byte fallback, leading space stripped."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "▁Hello": 2, "▁world": 3, "<0xE4>": 4, "<0xBD>": 5, "<0xA0>": 6, "!": 7}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")


def test_sentencepiece_first_output_token_keeps_its_leading_space() -> None:
    tok = sentencepiece_tokenizer()
    prompt, output = [2], [3, 4, 5, 6, 7, 1]
    deltas = stream(IncrementalDetokenizer(tok, prompt, skip_special_tokens=True), output)
    assert deltas == [" world", "", "", "你", "!", "", ""]
    assert "".join(deltas) == tok.decode(prompt + output, skip_special_tokens=True)[len("Hello") :]


def test_token_strings_and_bytes_of_a_split_emoji(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("😀")
    pieces = token_bytes(tok, ids)
    assert b"".join(pieces) == "😀".encode()
    strings = token_strings(tok, ids)
    assert strings == [p.decode("utf-8", errors="backslashreplace") for p in pieces]
    assert all("\\x" in s and "\ufffd" not in s for s in strings)


def test_token_strings_of_plain_and_special_tokens(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = [*tok.encode(" hello\n"), 2]
    assert token_strings(tok, ids) == [" hello", "\n", "<|im_end|>"]
    assert token_bytes(tok, ids)[-1] == b"<|im_end|>"


def test_token_bytes_agree_with_decode_over_the_whole_vocabulary(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = list(range(len(tok)))
    pieces = TokenTextCodec(tok).token_bytes(ids)
    for token_id, piece in zip(ids, pieces, strict=True):
        assert piece.decode("utf-8", errors="replace") == tok.decode([token_id]), token_id
    sample = tok.encode(" ".join(TEXTS))
    assert b"".join(token_bytes(tok, sample)) == tok.decode(sample).encode()


def test_token_bytes_with_sentencepiece_byte_fallback() -> None:
    tok = sentencepiece_tokenizer()
    assert token_bytes(tok, [2, 4, 5, 6, 1, 99]) == [b" Hello", b"\xe4", b"\xbd", b"\xa0", b"</s>", b""]
    assert token_strings(tok, [3, 4]) == [" world", "\\xe4"]

