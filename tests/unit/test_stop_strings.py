"""Stop strings over text streams, and the per-choice OutputProcessor that applies them to token ids."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine_server.output.processor import OutputProcessor
from engine_server.output.stop_strings import StopStringMatcher
from engine_server.output.types import ChoiceDelta, FinishReason
from engine_server.sampling_params import SamplingParams

IM_END = 2  # SmolLM2's <|im_end|>, its eos


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[list[str], str | None]:
    """Feeds every delta; returns what was emitted per call (flush last when nothing matched) and the match."""
    out, matched = [], None
    for d in deltas:
        emit, m = matcher.feed(d)
        out.append(emit)
        matched = matched or m
    if matched is None:
        out.append(matcher.flush())
    return out, matched


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Brute force over the whole text: the stop string that ends first, the longest on a tie."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def test_stop_split_across_deltas_is_never_emitted() -> None:
    out, matched = feed_all(StopStringMatcher(["\n\n"]), ["Hello\n", "\nWorld", "more"])
    assert out == ["Hello", "", ""]
    assert matched == "\n\n"


def test_partial_stop_is_held_then_released() -> None:
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("a\n") == ("a", None)
    assert matcher.feed("b\n") == ("\nb", None)
    assert matcher.flush() == "\n"
    assert matcher.matched is None


def test_stop_that_is_a_prefix_of_another_ends_first() -> None:
    assert feed_all(StopStringMatcher(["abc", "ab"]), ["xa", "bc"]) == (["x", ""], "ab")
    assert feed_all(StopStringMatcher(["abc", "b"]), ["abc"]) == (["a"], "b")


def test_tie_on_the_same_end_picks_the_longest() -> None:
    assert feed_all(StopStringMatcher(["b", "ab"]), ["xab"]) == (["x"], "ab")


def test_include_stop_str_in_output() -> None:
    out, matched = feed_all(StopStringMatcher(["END"], include_stop_str_in_output=True), ["text E", "NDtail"])
    assert "".join(out) == "text END"
    assert matched == "END"


def test_nothing_after_a_match_and_empty_stops_ignored() -> None:
    matcher = StopStringMatcher(["", "x"])
    assert matcher.feed("axb") == ("a", "x")
    assert matcher.feed("more") == ("", None)
    assert matcher.flush() == ""
    assert StopStringMatcher([""]).feed("abc") == ("abc", None)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("seed", range(200))
def test_any_split_gives_the_whole_text_result(seed: int, include: bool) -> None:
    rng = random.Random(seed)
    alphabet = "ab\n。😀"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    out, matched = feed_all(StopStringMatcher(stops, include), deltas)
    assert ("".join(out), matched) == reference(text, stops, include)
    if matched is not None and not include:
        assert matched not in "".join(out)


# --- OutputProcessor ------------------------------------------------------------------------------------


def run(
    tok: Any,
    text: str,
    params: SamplingParams,
    core_finish: FinishReason | None = None,
    stop_token_id: int | None = None,
) -> tuple[list[ChoiceDelta], list[int]]:
    """Feeds `text`'s tokens one per step (plus `stop_token_id`, if any) and the core's finish on the last."""
    ids = tok.encode(text) + ([stop_token_id] if stop_token_id is not None else [])
    proc = OutputProcessor(tok, tok.encode("<|im_start|>assistant\n"), params)
    deltas = []
    for n, token_id in enumerate(ids, start=1):
        last = n == len(ids)
        delta = proc.process([token_id], core_finish if last else None, stop_token_id if last else None)
        deltas.append(delta)
        if delta.finished:
            break
    return deltas, ids


def test_cjk_stop_string(smollm2_tokenizer: Any) -> None:
    deltas, _ = run(smollm2_tokenizer, "你好。再见", SamplingParams(stop=("。",)))
    final = deltas[-1]
    assert "".join(d.text for d in deltas) == "你好"
    assert (final.finished, final.finish_reason, final.matched_stop, final.abort_core) == (
        True,
        FinishReason.STOP,
        "。",
        True,
    )
    reported = [t for d in deltas for t in d.token_ids]
    assert smollm2_tokenizer.decode(reported) == "你好。"


def test_emoji_stop_string_spanning_tokens(smollm2_tokenizer: Any) -> None:
    params = SamplingParams(stop=("😀",), include_stop_str_in_output=True)
    deltas, _ = run(smollm2_tokenizer, "hi 😀 there", params)
    assert "".join(d.text for d in deltas) == "hi 😀"
    assert deltas[-1].matched_stop == "😀" and deltas[-1].abort_core
    assert not any("\ufffd" in d.text for d in deltas)


def test_double_newline_stop_across_tokens(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    assert tok.encode("a\n\nb")[1:3] == tok.encode("\n") * 2  # the stop really straddles two tokens
    deltas, _ = run(tok, "a\n\nb", SamplingParams(stop=("\n\n",)))
    assert [d.text for d in deltas] == ["a", "", ""]
    assert deltas[-1].matched_stop == "\n\n"


def test_held_text_flushed_when_core_finishes_for_length(smollm2_tokenizer: Any) -> None:
    deltas, _ = run(smollm2_tokenizer, "abc ST", SamplingParams(stop=("STOP",)), FinishReason.LENGTH)
    assert "".join(d.text for d in deltas) == "abc ST"
    assert deltas[-1].text.endswith("ST")
    final = deltas[-1]
    assert (final.finish_reason, final.matched_stop, final.abort_core) == (FinishReason.LENGTH, None, False)


def test_partial_character_flushed_on_abort(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("ok 😀")[:-1]
    proc = OutputProcessor(tok, [], SamplingParams())
    texts = [proc.process([i], None).text for i in ids[:-1]]
    final = proc.process(ids[-1:], FinishReason.ABORT)
    assert "".join(texts) + final.text == tok.decode(ids)
    assert final.finish_reason is FinishReason.ABORT and final.finished


@pytest.mark.parametrize(("skip", "include"), [(True, False), (False, False), (False, True)])
def test_eos_reports_the_token_id_and_hides_its_text(smollm2_tokenizer: Any, skip: bool, include: bool) -> None:
    params = SamplingParams(skip_special_tokens=skip, include_stop_str_in_output=include)
    deltas, ids = run(smollm2_tokenizer, "done", params, FinishReason.STOP, stop_token_id=IM_END)
    final = deltas[-1]
    assert (final.finish_reason, final.matched_stop, final.abort_core) == (FinishReason.STOP, IM_END, False)
    assert [t for d in deltas for t in d.token_ids] == ids
    assert "".join(d.text for d in deltas) == ("done<|im_end|>" if include else "done")


def test_tokens_after_a_stop_string_are_cut_and_later_calls_ignored(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("one. two. three")
    proc = OutputProcessor(tok, [], SamplingParams(stop=("two",)))
    delta = proc.process(ids, None)  # several tokens in one step
    assert delta.text == "one. " and delta.matched_stop == "two" and delta.abort_core
    assert tok.decode(delta.token_ids) == "one. two"
    late = proc.process(tok.encode(" four"), FinishReason.LENGTH)
    assert (late.text, late.token_ids, late.finished, late.abort_core) == ("", [], True, False)
    assert late.finish_reason is FinishReason.STOP and proc.finished


def test_min_tokens_defers_stop_strings(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("a. b. c")
    proc = OutputProcessor(tok, [], SamplingParams(stop=(".",), min_tokens=3))
    deltas = [proc.process([i], None) for i in ids]
    assert "".join(d.text for d in deltas) == "a. b"
    assert next(d for d in deltas if d.finished).matched_stop == "."


def test_no_stops_streams_everything(smollm2_tokenizer: Any) -> None:
    text = "plain text, 你好 😀"
    deltas, ids = run(smollm2_tokenizer, text, SamplingParams(), FinishReason.LENGTH)
    assert "".join(d.text for d in deltas) == text
    assert [t for d in deltas for t in d.token_ids] == ids
    assert deltas[-1].finish_reason is FinishReason.LENGTH
