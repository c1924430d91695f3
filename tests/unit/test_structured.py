"""Structured output without a model: constraint validation, the compile service (cache, errors, time limit,
in-flight dedupe) and the matchers' token bitmasks, on a tiny hand-made vocabulary."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import xgrammar as xgr

from engine_server.core.request import Request
from engine_server.errors import ValidationError
from engine_server.frontend import InputProcessor
from engine_server.sampling import Sampler, SamplingRow
from engine_server.sampling_params import SamplingParams
from engine_server.structured import Constraint, ConstraintKind
from engine_server.structured import compiler as compiler_module
from engine_server.structured.compiler import (
    COMPILE_NICENESS,
    CompiledConstraint,
    GrammarCompiler,
    GrammarCompilerConfig,
    XGrammarCompile,
    choice_ebnf,
    xgrammar_reason,
)
from engine_server.structured.constraint import json_depth
from engine_server.structured.matchers import GrammarMatchers, GrammarState

VOCAB = ["<s>", "</s>", "y", "es", "yes", "n", "o", "no", "{", "}", '"', "a", ":", " ", "1", ",", "b"]
EOS = 1
TOKEN = {text: i for i, text in enumerate(VOCAB)}
GENEROUS_S = 5.0  # bound on anything "immediate": other work shares these CPUs


def tiny_info() -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, stop_token_ids=[EOS])


@pytest.fixture
def compiler() -> Iterator[GrammarCompiler]:
    service = GrammarCompiler(tiny_info(), GrammarCompilerConfig(timeout_s=GENEROUS_S))
    yield service
    service.close()


class CountingCompile:
    """xgrammar's compile, counting calls per constraint, optionally held until `release` is set."""

    def __init__(self, info: xgr.TokenizerInfo, hold: threading.Event | None = None) -> None:
        self.real = XGrammarCompile(info, GrammarCompilerConfig())
        self.hold = hold
        self.calls: list[Constraint] = []

    def __call__(self, constraint: Constraint) -> xgr.CompiledGrammar:
        self.calls.append(constraint)
        if self.hold is not None:
            self.hold.wait()
        return self.real(constraint)


# -- constraints ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("constraint", "param", "fragment"),
    [
        (Constraint.choice([]), "choice", "at least one"),
        (Constraint.choice(["a", ""]), "choice", "non-empty"),
        (Constraint.regex(""), "regex", "non-empty"),
        (Constraint.grammar("x" * 300_000), "grammar", "at most"),
        (Constraint.json_schema("{nope"), "json_schema", "not valid JSON"),
        (Constraint.json_schema("[1, 2]"), "json_schema", "JSON object"),
        (Constraint(ConstraintKind.JSON_OBJECT, spec="{}"), "json_object", "no spec"),
        (Constraint(ConstraintKind.REGEX, "a", choices=("a",)), "regex", "no choices"),
        (Constraint.json_schema('{"a": ' * 128 + "{}" + "}" * 128), "json_schema", "129 levels deep; at most 128"),
        (Constraint.json_schema('{"a": ' * 5000 + "1" + "}" * 5000), "json_schema", "nested too deeply"),
    ],
)
def test_malformed_constraints_are_refused_before_compiling(constraint: Constraint, param: str, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment) as info:
        constraint.validate()
    assert info.value.param == param
    with pytest.raises(ValidationError, match=fragment):
        SamplingParams(constraint=constraint).validate(vocab_size=10, max_model_len=100, prompt_len=1)


def test_json_depth_counts_objects_and_arrays_without_recursion() -> None:
    assert [json_depth(v) for v in (1, {}, [], {"a": [1, {"b": None}]}, [[[[]]]])] == [0, 1, 1, 3, 4]
    deep: list[object] = []
    for _ in range(100_000):  # far past Python's recursion limit
        deep = [deep]
    assert json_depth(deep) == 100_001
    Constraint.json_schema({"type": "array", "items": {"type": "object"}}).validate()
    Constraint.json_schema('{"a": ' * 127 + "{}" + "}" * 127).validate()  # 128 levels: at the limit


def test_a_schema_mapping_keeps_its_key_order() -> None:
    constraint = Constraint.json_schema({"type": "object", "properties": {"z": {}, "a": {}}})
    assert constraint.spec.index('"z"') < constraint.spec.index('"a"')
    assert constraint == Constraint.json_schema(constraint.spec)  # equal specs share one cache entry


# -- the compile service ----------------------------------------------------------------------------------


def test_a_second_submit_is_served_from_the_cache() -> None:
    counting = CountingCompile(tiny_info())
    service = GrammarCompiler(tiny_info(), compile_fn=counting)
    try:
        first = service.compile(Constraint.regex("(yes|no)"))
        second = service.submit(Constraint.regex("(yes|no)"))
        assert second.done() and second.result() is first
        assert len(counting.calls) == 1
        assert service.cached(Constraint.regex("(yes|no)")) is first
    finally:
        service.close()


def test_the_vocabulary_is_read_by_the_first_compile_once() -> None:
    """Given a function that builds the tokenizer's info (`GrammarCompiler.for_tokenizer`'s), the service calls it
    at neither start nor close but once, from the first compile, however many compile at once after it."""
    builds: list[xgr.TokenizerInfo] = []

    def build() -> xgr.TokenizerInfo:
        builds.append(tiny_info())
        return builds[-1]

    service = GrammarCompiler(build, GrammarCompilerConfig(timeout_s=GENEROUS_S, num_workers=2))
    try:
        assert builds == []
        futures = [service.submit(Constraint.regex(spec)) for spec in ("(yes|no)", "y(es)?", "no")]
        assert all(future.result().grammar is not None for future in futures)
        assert len(builds) == 1
    finally:
        service.close()
    unused = GrammarCompiler(build)
    unused.close()
    assert len(builds) == 1


def test_the_cache_keeps_the_most_recently_used() -> None:
    service = GrammarCompiler(tiny_info(), GrammarCompilerConfig(cache_size=2))
    try:
        a, b, c = (Constraint.regex(p) for p in ("a", "b", "ab"))
        service.compile(a)
        service.compile(b)
        service.compile(a)  # a is now the most recent
        service.compile(c)
        assert service.cached(a) is not None and service.cached(c) is not None and service.cached(b) is None
    finally:
        service.close()


@pytest.mark.parametrize(
    ("constraint", "reason"),
    [
        (Constraint.regex("(ab"), "parenthesis is not closed"),
        (Constraint.grammar("root ::= foo"), 'Rule "foo" is not defined'),
        (Constraint.grammar("root ::= 'a"), "EBNF"),
        (Constraint.json_schema('{"type": "foo"}'), 'Unsupported type "foo"'),
    ],
)
def test_an_invalid_spec_fails_with_xgrammars_reason(
    compiler: GrammarCompiler, constraint: Constraint, reason: str
) -> None:
    with pytest.raises(ValidationError) as info:
        compiler.compile(constraint)
    assert reason in info.value.message
    assert info.value.param == constraint.kind.value
    assert ".cc:" not in info.value.message  # the C++ source prefix is stripped
    # A failure leaves the service working for the next spec.
    assert compiler.compile(Constraint.regex("yes")).constraint == Constraint.regex("yes")


def test_xgrammar_reason_strips_the_source_prefix_and_bounds_the_length() -> None:
    raw = RuntimeError("[12:04:15] /project/cpp/json_schema_converter.cc:4939: Check failed: (e) is false: Bad")
    assert xgrammar_reason(raw) == "Bad"
    assert len(xgrammar_reason(RuntimeError("x" * 10_000))) <= 500


def test_a_slow_compile_fails_at_the_limit_and_never_piles_up_threads() -> None:
    hold = threading.Event()
    counting = CountingCompile(tiny_info(), hold)
    limit = 0.3
    service = GrammarCompiler(tiny_info(), GrammarCompilerConfig(timeout_s=limit, num_workers=1), compile_fn=counting)
    slow, queued = Constraint.regex("yes"), Constraint.regex("no")
    threads_before = threading.active_count()
    try:
        start = time.monotonic()
        futures = [service.submit(slow) for _ in range(8)] + [service.submit(queued)]
        for future in futures:
            with pytest.raises(ValidationError, match=r"did not compile within 0\.3 s") as info:
                future.result(timeout=GENEROUS_S)
        assert info.value.param == "regex"
        assert limit <= time.monotonic() - start < GENEROUS_S
        # Eight submits of one spec joined one compile; the other spec waits behind it, on the one worker.
        assert counting.calls == [slow]
        assert threading.active_count() <= threads_before
        hold.set()  # the overlong compile ends in the background...
        deadline = time.monotonic() + GENEROUS_S
        while service.cached(slow) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service.cached(slow) is not None  # ...and its result is kept for a retry
        # The queued spec's callers all gave up before it started, so it was skipped, not compiled.
        assert service.compile(Constraint.regex("y")).grammar is not None
        assert queued not in counting.calls
    finally:
        hold.set()
        service.close()


def test_a_compile_that_ends_after_the_limit_fails_even_when_the_deadline_watch_is_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a busy host the watch thread may run only after the overlong compile has ended: its caller must still
    get the timeout, never a result past the limit (which would admit a request the limit refused)."""
    monkeypatch.setattr(compiler_module._DeadlineWatch, "add", lambda *args: None)  # a watch that never fires
    hold = threading.Event()
    service = GrammarCompiler(
        tiny_info(), GrammarCompilerConfig(timeout_s=0.05), compile_fn=CountingCompile(tiny_info(), hold)
    )
    try:
        late = service.submit(Constraint.regex("yes"))
        time.sleep(0.1)
        hold.set()
        with pytest.raises(ValidationError, match=r"did not compile within 0\.05 s"):
            late.result(timeout=GENEROUS_S)
        assert service.cached(Constraint.regex("yes")) is not None  # kept for a retry, as always
    finally:
        hold.set()
        service.close()


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")
def test_compile_workers_run_at_a_lower_priority_than_the_step_loop(compiler: GrammarCompiler) -> None:
    """On a host with few cores a long compile must take the CPU the step loop leaves over, not half of it."""
    assert compiler.compile(Constraint.regex("yes")).grammar is not None  # the workers are up
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    workers = [t.native_id for t in threading.enumerate() if t.name.startswith("grammar-compile-")]
    assert workers and all(
        os.getpriority(os.PRIO_PROCESS, tid) == min(own + COMPILE_NICENESS, 19) for tid in workers if tid is not None
    )
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # the caller's own is untouched


def test_a_cancelled_waiter_does_not_break_the_others() -> None:
    hold = threading.Event()
    service = GrammarCompiler(tiny_info(), compile_fn=CountingCompile(tiny_info(), hold))
    try:
        first, second = service.submit(Constraint.regex("yes")), service.submit(Constraint.regex("yes"))
        assert first.cancel()  # what asyncio.wrap_future does when its task is cancelled
        hold.set()
        assert isinstance(second.result(timeout=GENEROUS_S), CompiledConstraint)
    finally:
        service.close()


# -- the frontend seam ------------------------------------------------------------------------------------


def test_the_input_processor_compiles_before_building_requests(compiler: GrammarCompiler) -> None:
    inputs = InputProcessor(None, len(VOCAB), 64, [EOS], grammar_compiler=compiler)
    params = SamplingParams(n=2, constraint=Constraint.choice(["yes", "no"]))
    requests = inputs.make_requests("r", [0], params)  # compiles synchronously: no grammar was given
    assert [r.request_id for r in requests] == ["r/0", "r/1"]
    assert requests[0].grammar is requests[1].grammar is not None
    assert inputs.compile_constraint(SamplingParams()).result() is None
    with pytest.raises(ValidationError, match="not enabled"):
        InputProcessor(None, len(VOCAB), 64, [EOS]).compile_constraint(params).result()
    with pytest.raises(ValueError, match="does not match"):
        Request("x", [0], SamplingParams(), max_model_len=64, grammar=requests[0].grammar)


# -- bitmasks and matchers --------------------------------------------------------------------------------


def allowed_tokens(mask: torch.Tensor) -> set[str]:
    return {VOCAB[t] for t in range(len(VOCAB)) if (int(mask[t // 32]) >> (t % 32)) & 1}


def constrained_request(request_id: str, grammar: CompiledConstraint) -> Request:
    params = SamplingParams(constraint=grammar.constraint)
    return Request(request_id, [0], params, max_model_len=64, eos_token_ids=[EOS], grammar=grammar)


def test_bitmasks_follow_the_grammar_token_by_token(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(Constraint.regex("(yes|no)"))
    matchers = GrammarMatchers(len(VOCAB), torch.device("cpu"))
    request, plain = constrained_request("c", grammar), Request("p", [0], SamplingParams(), max_model_len=64)
    masks = matchers.bitmasks([plain, request])
    assert masks[0] is None and masks[1] is not None
    assert allowed_tokens(masks[1]) == {"y", "yes", "n", "no"}
    assert matchers.accept("c", TOKEN["y"]) is GrammarState.OPEN
    assert allowed_tokens(matchers.bitmasks([request])[0]) == {"es"}  # type: ignore[arg-type]
    # After "yes" nothing but a stop token could follow: the choice ends without sampling one.
    assert matchers.accept("c", TOKEN["es"]) is GrammarState.COMPLETE
    matchers.release("c")
    assert len(matchers) == 0


def test_draft_masks_walk_the_drafts_and_roll_the_matcher_back(compiler: GrammarCompiler) -> None:
    """Speculative decoding: the mask at each verified position is the one after the drafts before it; from a
    draft the grammar refuses, the masks repeat; the matcher stands where it was afterwards."""
    grammar = compiler.compile(Constraint.regex("(yes|no)(yes|no)"))
    matchers = GrammarMatchers(len(VOCAB), torch.device("cpu"))
    request = constrained_request("c", grammar)
    matchers.bitmasks([request])
    assert matchers.accept("c", TOKEN["y"]) is GrammarState.OPEN
    before = allowed_tokens(matchers.bitmasks([request])[0])  # type: ignore[arg-type]
    kept = matchers.draft_bitmasks(request, [TOKEN["es"], TOKEN["n"]])
    assert [allowed_tokens(m) for m in kept] == [{"es"}, {"y", "yes", "n", "no"}, {"o"}]
    refused = matchers.draft_bitmasks(request, [TOKEN["es"], TOKEN["a"], TOKEN["o"]])  # "a": outside the grammar
    second = {"y", "yes", "n", "no"}
    assert [allowed_tokens(m) for m in refused] == [{"es"}, second, second, second]
    assert allowed_tokens(matchers.bitmasks([request])[0]) == before == {"es"}  # type: ignore[arg-type]
    assert matchers.accept("c", TOKEN["es"]) is GrammarState.OPEN  # the real walk goes on from "y"


def test_a_grammar_that_may_go_on_waits_for_the_model_to_stop(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(Constraint.regex("y(es)?"))
    matchers = GrammarMatchers(len(VOCAB), torch.device("cpu"))
    request = constrained_request("c", grammar)
    matchers.bitmasks([request])
    assert matchers.accept("c", TOKEN["y"]) is GrammarState.OPEN  # complete, but "es" may still follow
    assert allowed_tokens(matchers.bitmasks([request])[0]) == {"es", "</s>"}  # type: ignore[arg-type]
    assert matchers.accept("c", EOS) is GrammarState.TERMINATED
    assert matchers.accept("c", TOKEN["y"]) is GrammarState.REJECTED


def test_the_sampler_never_picks_a_token_the_grammar_forbids(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(Constraint.choice(["no"]))
    request = constrained_request("c", grammar)
    mask = GrammarMatchers(len(VOCAB), torch.device("cpu")).bitmasks([request])[0]
    logits = torch.zeros(2, len(VOCAB))
    logits[:, TOKEN["yes"]] = 10.0  # the model prefers a forbidden token
    rows = [
        SamplingRow(SamplingParams(temperature=t), [0], [], frozenset({EOS}), position=1, allowed_token_bitmask=mask)
        for t in (0.0, 1.0)
    ]
    sampled = Sampler(len(VOCAB), "cpu", seed=0)(logits, rows).token_id_list()
    assert all(VOCAB[t] in {"n", "no"} for t in sampled)


def test_choices_with_quotes_backslashes_and_unicode_match_exactly(compiler: GrammarCompiler) -> None:
    choices = ['say "hi"', "back\\slash", "été 😀", "new\nline"]
    grammar = compiler.compile(Constraint.choice(choices))
    for text in choices:
        matcher = xgr.GrammarMatcher(grammar.grammar)
        assert matcher.accept_string(text) and matcher.is_completed(), text
    assert not xgr.GrammarMatcher(grammar.grammar).accept_string("say hi")
    assert choice_ebnf(["a"]) == 'root ::= "a"'


@pytest.mark.parametrize(
    ("max_ws", "text", "ok"),
    [(0, '{"a": 1}', True), (0, '{ "a": 1}', False), (2, '{  "a": [1,  2]}', True), (2, '{   "a": 1}', False)],
)
def test_json_whitespace_is_bounded(max_ws: int, text: str, ok: bool) -> None:
    service = GrammarCompiler(tiny_info(), GrammarCompilerConfig(json_max_whitespace=max_ws))
    try:
        matcher = xgr.GrammarMatcher(service.compile(Constraint.json_object()).grammar)
        assert matcher.accept_string(text) is ok
    finally:
        service.close()
