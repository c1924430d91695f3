"""How many drafts each decoding sequence verifies per step: as many as are likely enough to pay for themselves.

A draft costs the step the time of one more scheduled token (`c`, the step-time model's per-token rate) whether
it is kept or not; it earns a token with the probability that it and every draft before it are kept. A step
of N tokens in T seconds gains from a draft kept with probability p when (N + p) / (T + c) > N / T, that is when
p > c * N / T: the threshold. So on a GPU, or on the CPU at small batch, where a step's time hardly grows with
its tokens, speculation goes deep; at a batch large enough to be compute-bound, only drafts nearly sure to be
kept are worth their token, and with them speculation switches itself off. With the drafts j positions deep
kept with probability a^j (a: the sequence's measured rate of keeping a draft, an exponentially decayed count
from a hopeful prior), a sequence verifies the largest k with a^k above the threshold.

A sequence whose drafts stop paying still verifies one draft every `PROBE_EVERY` steps, so its rate (and the step
model's view of a draft's cost) can recover when the text it writes starts repeating. Without a step-time model,
or before it has measured a step, the threshold is `DEFAULT_THRESHOLD`.
"""

from __future__ import annotations

import math

from engine_server.core.step_timing import StepTimeModel

DEFAULT_THRESHOLD = 0.3
PROBE_EVERY = 8
_PRIOR_RATE = 0.7  # a new sequence's drafts are taken as kept this often, worth _PRIOR_TRIALS observations
_PRIOR_TRIALS = 2.0
_DECAY = 0.9  # per verified step: the rate follows the text the sequence writes now


class _Rate:
    """A sequence's decayed counts of drafts kept over drafts checked, and the steps since it last verified."""

    __slots__ = ("checked", "idle_steps", "kept")

    def __init__(self) -> None:
        self.kept = _PRIOR_RATE * _PRIOR_TRIALS
        self.checked = _PRIOR_TRIALS
        self.idle_steps = 0

    @property
    def value(self) -> float:
        return self.kept / self.checked


class DraftPolicy:
    """Per sequence, the number of drafts to verify next (`num_drafts`), learned from its verified steps."""

    def __init__(self, max_drafts: int, step_time: StepTimeModel | None, adaptive: bool = True) -> None:
        self.max_drafts = max_drafts
        self.step_time = step_time
        self.adaptive = adaptive
        self._rates: dict[str, _Rate] = {}

    def threshold(self, num_rows: int) -> float:
        """The least probability a draft must have of being kept to pay for its token in a step of `num_rows`
        decoding sequences (module docstring)."""
        model = self.step_time
        coef = model.coefficients if model is not None else None
        if coef is None or model is None:
            return DEFAULT_THRESHOLD
        step_s = model.predict(0, max(1, num_rows))
        if step_s is None or step_s <= 0:
            return DEFAULT_THRESHOLD
        return min(1.0, coef[1] * max(1, num_rows) / step_s)

    def num_drafts(self, request_id: str, threshold: float) -> int:
        """How many drafts the sequence should verify in its next step, given the step's `threshold`."""
        if not self.adaptive:
            return self.max_drafts
        rate = self._rates.get(request_id)
        if rate is None:
            rate = self._rates[request_id] = _Rate()
        a = rate.value
        if a <= threshold or a <= 0.0:
            depth = 0
        elif a >= 1.0:
            depth = self.max_drafts
        else:
            depth = min(self.max_drafts, math.floor(math.log(threshold) / math.log(a)) if threshold > 0 else 64)
        if depth == 0:
            rate.idle_steps += 1
            if rate.idle_steps >= PROBE_EVERY:
                depth = 1
        return depth

    def observe(self, request_id: str, num_drafts: int, num_kept: int) -> None:
        """A verified step of the sequence: `num_kept` of its `num_drafts` drafts were kept (a prefix of them)."""
        rate = self._rates.get(request_id)
        if rate is None or num_drafts <= 0:
            return
        checked = min(num_drafts, num_kept + 1)  # drafts after the first refused one were never really tried
        rate.kept = _DECAY * rate.kept + num_kept
        rate.checked = _DECAY * rate.checked + checked
        rate.idle_steps = 0

    def release(self, request_id: str) -> None:
        self._rates.pop(request_id, None)
