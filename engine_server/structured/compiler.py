"""The grammar compile service: constraints in, xgrammar grammars out, off the step loop, cached, time-limited.

Contract of `GrammarCompiler.submit`: it returns at once with a `concurrent.futures.Future` that resolves no
later than `timeout_s` after the call, with a `CompiledConstraint` or a `ValidationError` (param = the
constraint's kind) carrying xgrammar's reason: an invalid or unsupported spec, or one that did not compile in
time. The engine compiles *before* a request enters the core, so a slow grammar delays only its own request.

Threads: a fixed set of daemon workers compiles (xgrammar releases the GIL while it works) and one daemon
watcher fails futures at their deadline. A compile that overruns cannot be killed inside a thread: its
caller is answered at the limit and the worker finishes in the background. What keeps a pathological spec
from piling up threads: the worker count is fixed, submissions of a spec already compiling join that compile
instead of starting another, and a queued compile whose callers have all timed out is skipped. A compile that
finishes after its callers gave up still goes into the cache, so a retry is served at once. While every
worker is busy with overlong compiles, new specs wait in the queue and may time out; cached specs never wait.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
import queue
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import structlog
import xgrammar as xgr
from xgrammar.structural_tag import (
    AnyTextFormat,
    GrammarFormat,
    OptionalFormat,
    SequenceFormat,
    StructuralTag,
    TagFormat,
)

from engine_server.errors import ValidationError
from engine_server.structured.constraint import Constraint, ConstraintKind

log = structlog.get_logger(__name__)

_MAX_REASON_CHARS = 500
# Scheduling niceness of the compile workers (and of the threads xgrammar starts from them, which inherit it): on
# a host with few cores a long compile then takes the CPU the step loop leaves over instead of an equal share.
COMPILE_NICENESS = 10
# xgrammar's C++ errors start with "[12:04:15] /project/cpp/file.cc:83: " and often "Check failed: (...) is
# false: "; the caller needs the sentence after them.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: (?:Check failed: .*? is false: )?")


@dataclass(frozen=True)
class GrammarCompilerConfig:
    """Knobs of the compile service; the defaults suit one engine."""

    timeout_s: float = 10.0  # a spec not compiled this long after submit fails its request
    num_workers: int = 2  # compiles running at once; also the most threads a slow spec can hold
    cache_size: int = 256  # compiled grammars kept, least recently used dropped first
    xgrammar_threads: int = 2  # threads xgrammar itself uses inside one compile
    # Whitespace JSON output may hold between tokens. 0: compact JSON with ", " and ": " separators only,
    # so a model cannot emit whitespace until max_tokens; N > 0: at most N whitespace characters per gap.
    json_max_whitespace: int = 0


@dataclass(frozen=True, eq=False)
class CompiledConstraint:
    """A constraint and its compiled grammar: immutable, shared by every request with the same constraint."""

    constraint: Constraint
    grammar: xgr.CompiledGrammar


CompileFn = Callable[[Constraint], xgr.CompiledGrammar]


def build_tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a tokenizer, sized to the model's vocabulary (which may exceed the tokenizer's).

    `stop_token_ids` are the tokens that end a complete sentence (the engine's eos ids). Building it walks the
    whole vocabulary (~0.4 s of CPU for 49,152 tokens), so do it once per tokenizer.
    """
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON string escapes are valid EBNF escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


TokenizerInfoSource = xgr.TokenizerInfo | Callable[[], xgr.TokenizerInfo]


class XGrammarCompile:
    """The real compile function: one `xgrammar.GrammarCompiler`, safe to call from several threads.

    `tokenizer_info` may be a function that builds it: it is called once, by the first compile (under a lock), so an
    engine that never constrains its output never walks its vocabulary (as vLLM starts its structured-output backend
    with the first request that asks for one). That compile's time limit includes the build."""

    def __init__(self, tokenizer_info: TokenizerInfoSource, config: GrammarCompilerConfig) -> None:
        self._tokenizer_info = tokenizer_info
        self._max_threads = config.xgrammar_threads
        self._compiler: xgr.GrammarCompiler | None = None
        self._build_lock = threading.Lock()
        ws = config.json_max_whitespace
        self._json_kwargs: dict[str, Any] = (
            {"any_whitespace": False} if ws <= 0 else {"any_whitespace": True, "max_whitespace_cnt": ws}
        )

    def __call__(self, constraint: Constraint) -> xgr.CompiledGrammar:
        grammar = self.grammar(constraint)
        if constraint.after_reasoning in ("inside", "if_opened"):
            grammar = after_reasoning(grammar, constraint.after_reasoning, constraint.reasoning_tags)
        elif constraint.after_reasoning == "harmony":
            grammar = harmony_answer(grammar)
        return self._grammar_compiler().compile_grammar(grammar)

    def _grammar_compiler(self) -> xgr.GrammarCompiler:
        with self._build_lock:
            if self._compiler is None:
                source = self._tokenizer_info
                info = source if isinstance(source, xgr.TokenizerInfo) else source()
                # Our own LRU caches by constraint, so xgrammar's cache would only hold a second copy.
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)
            return self._compiler

    def grammar(self, constraint: Constraint) -> xgr.Grammar:
        """The constraint's language as an uncompiled grammar."""
        kind = constraint.kind
        if kind is ConstraintKind.JSON_SCHEMA:
            return xgr.Grammar.from_json_schema(constraint.spec, **self._json_kwargs)
        if kind is ConstraintKind.JSON_OBJECT:
            # A schema rather than xgrammar's builtin JSON grammar, whose whitespace is unbounded.
            return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **self._json_kwargs)
        if kind is ConstraintKind.REGEX:
            return xgr.Grammar.from_regex(constraint.spec)
        if kind is ConstraintKind.CHOICE:
            return xgr.Grammar.from_ebnf(choice_ebnf(constraint.choices))
        return xgr.Grammar.from_ebnf(constraint.spec)


def harmony_answer(answer: xgr.Grammar) -> xgr.Grammar:
    """`answer` as the body of a harmony final message (gpt-oss, `engine_server.harmony`), after at most one free
    analysis message: `[<|channel|>analysis<|message|> text <|end|><|start|>assistant]
    <|channel|>final<|message|>` answer `<|return|>` (its end of sequence, here part of the language)."""
    analysis = TagFormat(
        begin="<|channel|>analysis<|message|>", content=AnyTextFormat(), end="<|end|><|start|>assistant"
    )
    final = TagFormat(begin="<|channel|>final<|message|>", content=GrammarFormat(grammar=str(answer)), end="<|return|>")
    tag = StructuralTag(format=SequenceFormat(elements=[OptionalFormat(content=analysis), final]))
    return xgr.Grammar.from_structural_tag(tag)


_WHITESPACE = r"root ::= [ \n\t\r]*"


def _literal_grammar(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text, ensure_ascii=False)}")


def after_reasoning(answer: xgr.Grammar, start: str, tags: tuple[str, ...] = ("<think>", "</think>")) -> xgr.Grammar:
    """`answer` after a thinking model's reasoning (`Constraint.after_reasoning`) between `tags` (opening, closing):
    "inside" (the prompt opened the reasoning): any text up to the first closing tag (xgrammar's any-text, which
    ends where the tag first occurs, as `engine_server.reasoning` splits), the tag, whitespace, then the answer;
    "if_opened": that after whitespace and the opening tag, or the answer alone. Two further tags are the markers
    the family wraps its answer in: the answer may stand between them."""
    opening, closing = tags[:2]
    if len(tags) == 4:
        wrapped = xgr.Grammar.concat(_literal_grammar(tags[2]), answer, _literal_grammar(tags[3]))
        answer = xgr.Grammar.union(wrapped, answer)

    def thought(begin: str) -> xgr.Grammar:
        reasoning = StructuralTag(format=TagFormat(begin=begin, content=AnyTextFormat(), end=closing))
        whitespace = xgr.Grammar.from_ebnf(_WHITESPACE)
        return xgr.Grammar.concat(xgr.Grammar.from_structural_tag(reasoning), whitespace, answer)

    if start == "inside":
        return thought("")
    if start == "if_opened":
        return xgr.Grammar.union(xgr.Grammar.concat(xgr.Grammar.from_ebnf(_WHITESPACE), thought(opening)), answer)
    raise ValueError(f"after_reasoning must be inside or if_opened, got {start!r}")


@dataclass(eq=False)
class _Job:
    """One compile of one constraint; every caller waiting on it holds a future in `waiters`, with the
    `time.monotonic()` deadline it must be answered by."""

    constraint: Constraint
    waiters: list[tuple[Future[CompiledConstraint], float]] = field(default_factory=list)


class GrammarCompiler:
    """Compiles constraints for one tokenizer in worker threads, with a cache and a per-call time limit.

    Thread-safe: submit from any thread or event loop (wrap the future with `asyncio.wrap_future`).
    """

    def __init__(
        self,
        tokenizer_info: TokenizerInfoSource,
        config: GrammarCompilerConfig | None = None,
        *,
        compile_fn: CompileFn | None = None,
    ) -> None:
        """`tokenizer_info`, or a function that builds it on the first compile (`XGrammarCompile`). `compile_fn`
        replaces xgrammar's compile (tests inject slow or failing ones)."""
        self.config = config or GrammarCompilerConfig()
        self._compile_fn = compile_fn or XGrammarCompile(tokenizer_info, self.config)
        self._lock = threading.Lock()
        self._cache: OrderedDict[Constraint, CompiledConstraint] = OrderedDict()
        self._inflight: dict[Constraint, _Job] = {}
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._watch = _DeadlineWatch()
        # Daemon threads: an overlong compile must never hold up interpreter exit.
        self._workers = [
            threading.Thread(target=self._work, name=f"grammar-compile-{i}", daemon=True)
            for i in range(max(1, self.config.num_workers))
        ]
        for worker in self._workers:
            worker.start()

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        config: GrammarCompilerConfig | None = None,
    ) -> GrammarCompiler:
        """The compiler of one Hugging Face tokenizer; see `build_tokenizer_info` for the arguments, built by the first
        compile (`XGrammarCompile`)."""
        stops = list(stop_token_ids)
        return cls(lambda: build_tokenizer_info(tokenizer, vocab_size, stops), config)

    def submit(self, constraint: Constraint) -> Future[CompiledConstraint]:
        """Start (or join, or serve from cache) the compile of `constraint`; see the module docstring."""
        future: Future[CompiledConstraint] = Future()
        deadline = time.monotonic() + self.config.timeout_s
        try:
            constraint.validate()
        except ValidationError as exc:
            future.set_exception(exc)
            return future
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler is closed")
            cached = self._cache.get(constraint)
            if cached is not None:
                self._cache.move_to_end(constraint)
            else:
                job = self._inflight.get(constraint)
                if job is None:
                    job = self._inflight[constraint] = _Job(constraint)
                    self._queue.put(job)
                job.waiters.append((future, deadline))
        if cached is not None:
            future.set_result(cached)
        else:
            self._watch.add(deadline, future, self._timeout_error(constraint))
        return future

    def compile(self, constraint: Constraint) -> CompiledConstraint:
        """Blocking `submit`: the compiled constraint, or ValidationError within the time limit."""
        return self.submit(constraint).result()

    def cached(self, constraint: Constraint) -> CompiledConstraint | None:
        """The compiled constraint if it is in the cache (does not touch the LRU order)."""
        with self._lock:
            return self._cache.get(constraint)

    def close(self) -> None:
        """Stop the workers once their current compile ends; pending futures still resolve by their deadline."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._watch.close()
        for _ in self._workers:
            self._queue.put(None)

    def _timeout_error(self, constraint: Constraint) -> ValidationError:
        return ValidationError(
            f"{constraint.kind.value} did not compile within {self.config.timeout_s:g} s; simplify it",
            param=constraint.param,
        )

    def _work(self) -> None:
        _lower_thread_priority()
        while (job := self._queue.get()) is not None:
            self._run(job)

    def _run(self, job: _Job) -> None:
        constraint = job.constraint
        with self._lock:
            if all(w.done() for w, _ in job.waiters):  # every caller timed out (or cancelled) while it queued
                del self._inflight[constraint]
                return
        result: CompiledConstraint | None = None
        error: ValidationError | None = None
        started = time.monotonic()
        try:
            result = CompiledConstraint(constraint, self._compile_fn(constraint))
        except Exception as exc:  # xgrammar reports every bad spec as an exception; each one is the caller's
            error = ValidationError(f"invalid {constraint.kind.value}: {xgrammar_reason(exc)}", param=constraint.param)
        elapsed = time.monotonic() - started
        if elapsed > self.config.timeout_s:
            log.warning("slow grammar compile", kind=constraint.kind.value, seconds=round(elapsed, 1))
        with self._lock:
            del self._inflight[constraint]  # from here on a new submit starts afresh or hits the cache
            if result is not None:
                self._cache[constraint] = result
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)
            waiters = job.waiters
        finished = time.monotonic()
        for waiter, deadline in waiters:
            # The watch thread may not have run yet (a busy host): a caller past its deadline still gets the
            # timeout, so the outcome depends on the compile's time alone, never on which thread wins.
            late = finished > deadline and error is None
            _settle(waiter, None if late else result, self._timeout_error(constraint) if late else error)


def xgrammar_reason(exc: BaseException) -> str:
    """The human part of an xgrammar error message, without its C++ source prefix, bounded in length."""
    text = _XGRAMMAR_PREFIX.sub("", str(exc).strip()) or type(exc).__name__
    # Some messages echo the whole spec after this marker; the caller sent it, so it adds only bulk.
    text = text.split(" The JSON string is:", 1)[0].strip()
    return text if len(text) <= _MAX_REASON_CHARS else text[: _MAX_REASON_CHARS - 3] + "..."


def _settle(future: Future[CompiledConstraint], result: CompiledConstraint | None, error: BaseException | None) -> None:
    """Resolve `future` unless it already is (timed out, or cancelled by an asyncio wrapper)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]
    except InvalidStateError:
        pass


def _lower_thread_priority() -> None:
    """Give the calling thread COMPILE_NICENESS (Linux, where a thread id names one thread to setpriority)."""
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
        except OSError as exc:  # e.g. a sandbox that forbids it: compiles still work, at normal priority
            log.debug("cannot lower the compile thread's priority", error=str(exc))


class _DeadlineWatch:
    """One daemon thread that fails each registered future still pending at its deadline."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, Future[CompiledConstraint], BaseException]] = []
        self._seq = itertools.count()  # tie-break: futures do not order
        self._closed = False
        threading.Thread(target=self._loop, name="grammar-deadlines", daemon=True).start()

    def close(self) -> None:
        """Let the thread end once every registered future is settled."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def add(self, deadline: float, future: Future[CompiledConstraint], error: BaseException) -> None:
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._seq), future, error))
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            expired: list[tuple[Future[CompiledConstraint], BaseException]] = []
            with self._cond:
                now = time.monotonic()
                while self._heap and (self._heap[0][0] <= now or self._heap[0][2].done()):
                    _, _, future, error = heapq.heappop(self._heap)
                    expired.append((future, error))
                if not expired and self._closed and not self._heap:
                    return
                if not expired:
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
            # Settled outside the lock: done-callbacks run here and may submit again.
            for future, error in expired:
                _settle(future, None, error)
