"""Probes on a live EngineCore's step loop: per-step phase timers and a per-phase torch-op counter.

Both replace bound methods of the core's parts by thin wrappers (instance attributes, put back on exit), so
nothing in engine_server changes. A timer wrapper costs two `perf_counter` calls and an addition per call: about
3 us per step in all (measured at B=1: 0.087 ms per step without the recorder, 0.090 with it).

What is reported is the *decode steady state*: steps whose schedule holds exactly B requests of one token each
(every request admitted and decoding). A step's time runs from its `step()` call to the next call, so the
caller's handling of its outputs counts; it is taken only for a full decode step followed by another, which
leaves out the step in which the requests finish (where the offline API detokenizes them whole).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import statistics
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine_server.core.engine_core import EngineCore
from engine_server.sampling import Sampler, SamplerOutput, SamplingMetadata, SamplingRow

# The timed parts of a step, in the order of `StepRecord.phases`; "rest" (what is left) is not timed itself.
TIMED_PHASES = ("schedule", "launch", "collect", "update_from_output")
# Where the counted ops of a step happen: "inputs" is launch outside the forward, the logits and the sampler.
OP_PHASES = ("schedule", "inputs", "logits", "sampling", "collect", "rest")


@contextlib.contextmanager
def replaced(obj: Any, name: str, value: Any) -> Iterator[None]:
    """`obj.name` is `value` while the block runs; then the instance's own attribute as it was (or none)."""
    own = vars(obj)
    had, saved = name in own, own.get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, saved)
        else:
            delattr(obj, name)


def wrapped(obj: Any, name: str, wrap: Callable[[Any], Any]) -> contextlib.AbstractContextManager[None]:
    """`obj.name` replaced by `wrap(obj.name)` (a wrapper of the bound method) while the block runs."""
    return replaced(obj, name, wrap(getattr(obj, name)))


def _is_full_decode(rows: int, tokens: int, batch_size: int) -> bool:
    return rows == batch_size and tokens == batch_size


@dataclass
class StepRecord:
    """One `step()` call: when it started, what its schedule held, seconds spent in each of TIMED_PHASES, and
    seconds of garbage collection until the next call (in whichever phase it fell)."""

    start: float
    rows: int = 0
    tokens: int = 0
    phases: list[float] = field(default_factory=lambda: [0.0] * len(TIMED_PHASES))
    gc: float = 0.0


@dataclass(frozen=True)
class StepTimes:
    """The decode steady state of one run, in milliseconds per step."""

    steps: int
    ms_per_step: float  # mean
    ms_per_step_p50: float
    phases_ms: dict[str, float]  # mean per step, TIMED_PHASES and "rest"
    gc_ms: float  # mean per step, already inside the phases: one full collection is ~0.1 s, so it shows in the mean


class StepRecorder:
    """Times every `step()` of `core` and the TIMED_PHASES inside it while `attached`.

    The records are appended on the thread that steps the core; read them (`take`) only while it is idle.
    """

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.steps: list[StepRecord] = []
        self._current = StepRecord(0.0)
        self._gc_started = 0.0

    @contextlib.contextmanager
    def attached(self) -> Iterator[StepRecorder]:
        scheduler, runner = self.core.scheduler, self.core.runner
        with contextlib.ExitStack() as stack:
            stack.enter_context(wrapped(self.core, "step", self._step))
            stack.enter_context(wrapped(scheduler, "schedule", self._schedule))
            stack.enter_context(wrapped(runner, "launch", lambda fn: self._timer(1, fn)))
            stack.enter_context(wrapped(runner, "collect", lambda fn: self._timer(2, fn)))
            stack.enter_context(wrapped(scheduler, "update_from_output", lambda fn: self._timer(3, fn)))
            gc.callbacks.append(self._on_gc)
            stack.callback(gc.callbacks.remove, self._on_gc)
            yield self

    def take(self) -> list[StepRecord]:
        """The records so far, which are forgotten here."""
        steps, self.steps = self.steps, []
        return steps

    def _step(self, step: Callable[[], Any]) -> Callable[[], Any]:
        def timed() -> Any:
            self._current = StepRecord(perf_counter())
            self.steps.append(self._current)
            return step()

        return timed

    def _schedule(self, schedule: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = perf_counter()
            output = schedule(*args, **kwargs)
            record = self._current
            record.phases[0] += perf_counter() - started
            # O(1): B rows holding B tokens are B one-token decodes (SchedulerOutput's own counts loop over rows).
            record.rows, record.tokens = output.num_rows, output.num_batched_tokens
            return output

        return timed

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = perf_counter()
        else:
            self._current.gc += perf_counter() - self._gc_started

    def _timer(self, index: int, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._current.phases[index] += perf_counter() - started

        return timed


def decode_step_times(steps: list[StepRecord], batch_size: int) -> StepTimes | None:
    """The full decode steps of `steps` that another one follows; None when there are none."""
    intervals: list[float] = []
    phases = [0.0] * len(TIMED_PHASES)
    collecting = 0.0
    for step, following in itertools.pairwise(steps):
        if _is_full_decode(step.rows, step.tokens, batch_size) and _is_full_decode(
            following.rows, following.tokens, batch_size
        ):
            intervals.append(following.start - step.start)
            phases = [total + spent for total, spent in zip(phases, step.phases, strict=True)]
            collecting += step.gc
    if not intervals:
        return None
    count = len(intervals)
    mean_s = sum(intervals) / count
    phases_ms = {name: round(1e3 * spent / count, 4) for name, spent in zip(TIMED_PHASES, phases, strict=True)}
    phases_ms["rest"] = round(1e3 * (mean_s - sum(phases) / count), 4)
    median_ms = round(1e3 * statistics.median(intervals), 4)
    return StepTimes(count, round(1e3 * mean_s, 4), median_ms, phases_ms, round(1e3 * collecting / count, 4))


# Ops that only make a new view or hand their input back (a fresh tensor lifted, no conjugate bit to resolve):
# dispatched, so they cost host time, but they launch no kernel on a GPU.
_NO_KERNEL = frozenset({"lift_fresh", "detach", "alias", "resolve_conj", "resolve_neg"})


def launches_kernel(func: Any) -> bool:
    """Whether an aten op would launch device work: not a view, nor one that hands its input back."""
    return not (getattr(func, "is_view", False) or func.name().split("::")[-1].split(".")[0] in _NO_KERNEL)


@dataclass
class _OpStep:
    rows: int = 0
    tokens: int = 0
    launching: int = 0
    by_phase: Counter[str] = field(default_factory=Counter)
    by_name: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class OpCounts:
    """Torch ops dispatched per decode step outside the model's forward (means over the steps counted)."""

    steps: int
    ops_per_step: float
    launching_ops_per_step: float  # of them, those that launch device work (`launches_kernel`)
    ops_by_phase: dict[str, float]  # OP_PHASES
    ops_by_name: dict[str, float]  # aten op -> count, most frequent first


class OpCounter(TorchDispatchMode):
    """Counts every torch op dispatched while it is the active mode, by phase and by step, except while paused.

    These are the ops a GPU step would launch eagerly around a captured forward (on the CPU the host -> device
    copies are no-ops and do not show; `.tolist()` shows as resolve_conj / resolve_neg).
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = "rest"
        self.paused = False
        self.steps: list[_OpStep] = []
        self._current = _OpStep()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if not self.paused:
            self._current.by_phase[self.phase] += 1
            self._current.by_name[str(func)] += 1
            if launches_kernel(func):
                self._current.launching += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        previous, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = previous

    def phased(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self.in_phase(phase):
                return fn(*args, **kwargs)

        return counted

    def new_step(self) -> None:
        self._current = _OpStep()
        self.steps.append(self._current)

    def scheduled(self, rows: int, tokens: int) -> None:
        self._current.rows, self._current.tokens = rows, tokens

    def decode_counts(self, batch_size: int) -> OpCounts | None:
        """Means over the full decode steps that another one follows (as `decode_step_times`)."""
        counted = [
            step
            for step, following in itertools.pairwise(self.steps)
            if _is_full_decode(step.rows, step.tokens, batch_size)
            and _is_full_decode(following.rows, following.tokens, batch_size)
        ]
        if not counted:
            return None
        by_phase: Counter[str] = Counter()
        by_name: Counter[str] = Counter()
        for step in counted:
            by_phase.update(step.by_phase)
            by_name.update(step.by_name)
        n = len(counted)
        return OpCounts(
            steps=n,
            ops_per_step=round(sum(by_phase.values()) / n, 2),
            launching_ops_per_step=round(sum(step.launching for step in counted) / n, 2),
            ops_by_phase={phase: round(by_phase[phase] / n, 2) for phase in OP_PHASES},
            ops_by_name={name: round(count / n, 2) for name, count in by_name.most_common()},
        )


class _CountedSampler(Sampler):
    """The real sampler, its calls counted as the "sampling" phase."""

    def __init__(self, vocab_size: int, device: torch.device, counter: OpCounter) -> None:
        super().__init__(vocab_size, device, seed=0)
        self._counter = counter
        self.cpu_shortcuts = False  # count what a GPU step launches, not the CPU's top-p shortcut

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        with self._counter.in_phase("sampling"):
            return super().__call__(logits, rows)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        with self._counter.in_phase("sampling"):
            return super().sample(logits, meta)

    def argmax(self, logits: torch.Tensor) -> SamplerOutput:
        with self._counter.in_phase("sampling"):
            return super().argmax(logits)


@contextlib.contextmanager
def counting_ops(core: EngineCore, real_forward: bool = False) -> Iterator[OpCounter]:
    """Count the ops of every `step()` of `core` by OP_PHASES while the block runs, on this thread.

    The model's forward is not counted. Unless `real_forward`, it is not even run: zeros of its output's shape
    stand in (a real forward of 256 sequences takes seconds on the CPU and would change no count).
    """
    counter = OpCounter()
    scheduler, runner = core.scheduler, core.runner
    model = runner.model
    hidden_size = core.model_config.hidden_size

    def step(fn: Callable[[], Any]) -> Callable[[], Any]:
        def counted() -> Any:
            counter.new_step()
            return fn()

        return counted

    def schedule(fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with counter.in_phase("schedule"):
                output = fn(*args, **kwargs)
            counter.scheduled(output.num_rows, output.num_batched_tokens)
            return output

        return counted

    def forward(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def uncounted(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            with counter.pause():
                if real_forward:
                    return fn(input_ids, *args, **kwargs)
                return torch.zeros(input_ids.shape[0], hidden_size, dtype=runner.dtype, device=input_ids.device)

        return uncounted

    with contextlib.ExitStack() as stack:
        stack.enter_context(wrapped(core, "step", step))
        stack.enter_context(wrapped(scheduler, "schedule", schedule))
        stack.enter_context(wrapped(runner, "launch", lambda fn: counter.phased("inputs", fn)))
        stack.enter_context(wrapped(runner, "collect", lambda fn: counter.phased("collect", fn)))
        stack.enter_context(wrapped(model, "forward", forward))
        stack.enter_context(wrapped(model, "compute_logits", lambda fn: counter.phased("logits", fn)))
        stack.enter_context(wrapped(runner, "_sampling_metadata", lambda fn: counter.phased("sampling", fn)))
        sampler = _CountedSampler(runner.sampler.vocab_size, runner.device, counter)
        stack.enter_context(replaced(runner, "sampler", sampler))
        stack.enter_context(counter)
        yield counter
