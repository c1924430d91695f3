"""How many drafts each decoding sequence verifies per step: as many as are likely enough to pay for themselves.

A draft costs the step the time of one more scheduled token (`c`, the step-time model's per-token rate) whether
it is kept or not; it earns a token with the probability that it and every draft before it are kept. A step
of N tokens in T seconds gains from a draft kept with probability p when (N + p) / (T + c) > N / T, that is when
p > c * N / T: the threshold. So on a GPU, or on the CPU at small batch, where a step's time hardly grows with
its tokens, speculation goes deep; at a batch large enough to be compute-bound, only drafts nearly sure to be
kept are worth their token, and with them speculation switches itself off. A sequence verifies the drafts
whose chance of being kept is above the threshold: the chance of draft j is the product of the sequence's
measured rates of keeping draft i once drafts 1..i-1 were kept, for i up to j (exponentially decayed counts
from a hopeful prior; a depth not tried yet takes the rate of the deepest one tried). Per depth, because
acceptance comes in runs: a proposal that copies the right place tends to be right all the way, so the first
draft is the doubtful one and the later ones are nearly sure; one rate for every depth would stop far short.

The cost of a draft is learned apart from the engine's own step-time model, which prefill dominates (a prompt
token attends to a long context and costs more than a draft) and which leans towards one rate per token (no
overhead) until the steps' mix tells them apart: here `DraftCost` fits the steps without prefill alone, seconds =
base + per_row * decode rows + per_draft * drafts, by exponentially weighted least squares. The rate of a draft
is known once the steps' draft counts vary, which the policy's own choices make them do.

A sequence whose drafts stop paying still verifies one draft every `PROBE_EVERY` steps, so its rate (and the cost
model's view of a draft) can recover when the text it writes starts repeating. Before the cost model has measured
a step, the threshold is `DEFAULT_THRESHOLD`.
"""

from __future__ import annotations

import math

import numpy as np

DEFAULT_THRESHOLD = 0.3
MAX_SURPRISE = 2.0
PROBE_EVERY = 8
_PRIOR_RATE = 0.7  # a new sequence's drafts are taken as kept this often, worth _PRIOR_TRIALS observations
_PRIOR_TRIALS = 2.0
_DECAY = 0.9  # per verified step: the rate follows the text the sequence writes now


class DraftCost:
    """Seconds of a step without prefill from its decode rows and drafts (module docstring). Pure state, no clock."""

    def __init__(self, decay: float = 0.98, ridge: float = 1e-3) -> None:
        self.decay = decay
        self.ridge = ridge
        self._xx = np.zeros((3, 3))
        self._xy = np.zeros(3)
        self.coefficients: tuple[float, float, float] | None = None  # (base, per_row, per_draft) in seconds

    def observe(self, num_rows: int, num_drafts: int, seconds: float) -> None:
        if num_rows <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        x = np.array([1.0, float(num_rows), float(num_drafts)])
        if self.coefficients is not None:
            # A stalled step (another process took the CPU) counts as at most twice its prediction: one stall
            # would otherwise make drafts look dear for the next fifty steps.
            predicted = float(np.dot(self.coefficients, x))
            if predicted > 0:
                seconds = min(seconds, MAX_SURPRISE * predicted)
        self._xx = self.decay * self._xx + np.outer(x, x)
        self._xy = self.decay * self._xy + x * seconds
        # The ridge only breaks ties a batch of constant size leaves (base vs per-row): it is ~1e-3 steps' worth.
        base, per_row, per_draft = np.linalg.solve(self._xx + self.ridge * np.eye(3), self._xy).tolist()
        self.coefficients = (base, per_row, per_draft)

    def threshold(self, num_rows: int) -> float | None:
        """A draft's cost over the time per token of a step of `num_rows` rows without drafts, in [0, 1]; None
        before the first step or while the fit says a step costs nothing."""
        if self.coefficients is None:
            return None
        base, per_row, per_draft = self.coefficients
        step_s = base + per_row * num_rows
        if step_s <= 0:
            return None
        return min(1.0, max(0.0, per_draft * num_rows / step_s))


class _Rates:
    """A sequence's decayed counts, per draft depth, of drafts kept over drafts tried after every earlier one was
    kept, in two tables: for steps after one that kept every draft it verified, and for the others. Runs come in
    streaks (the text copies its source, or it does not): measured on the editing benchmark, a row after a fully
    kept one keeps everything 81% of the time and nothing 3%, a row after a refusal nothing about 40%. Also the
    steps since the sequence last verified a draft."""

    __slots__ = ("after_full", "idle_steps", "kept", "tried")

    def __init__(self, max_drafts: int) -> None:
        self.kept = [[_PRIOR_RATE * _PRIOR_TRIALS] * max_drafts for _ in range(2)]
        self.tried = [[_PRIOR_TRIALS] * max_drafts for _ in range(2)]
        self.after_full = 0  # which table: 1 when the last verified row kept all its drafts
        self.idle_steps = 0

    def depth(self, threshold: float, max_drafts: int) -> int:
        """The drafts whose chance of being kept (the product of the rates up to them) stays above `threshold`."""
        kept, tried = self.kept[self.after_full], self.tried[self.after_full]
        chance, deepest_rate = 1.0, _PRIOR_RATE
        for j in range(max_drafts):
            # A depth barely tried yet (only its prior) takes the deepest tried depth's rate.
            rate = kept[j] / tried[j] if tried[j] > _PRIOR_TRIALS + 0.5 else deepest_rate
            deepest_rate = rate
            chance *= rate
            if chance <= threshold:
                return j
        return max_drafts

    def observe(self, num_drafts: int, num_kept: int) -> None:
        kept, tried = self.kept[self.after_full], self.tried[self.after_full]
        for j in range(min(num_drafts, num_kept + 1)):  # drafts after the first refused one were never tried
            kept[j] = _DECAY * kept[j] + (1.0 if j < num_kept else 0.0)
            tried[j] = _DECAY * tried[j] + 1.0
        self.after_full = int(num_kept == num_drafts)
        self.idle_steps = 0


class DraftPolicy:
    """Per sequence, the number of drafts to verify next (`num_drafts`), learned from its verified steps."""

    def __init__(self, max_drafts: int, adaptive: bool = True) -> None:
        self.max_drafts = max_drafts
        self.adaptive = adaptive
        self.cost = DraftCost()
        self._rates: dict[str, _Rates] = {}

    def observe_step(
        self, num_prefill_tokens: int, num_draft_tokens: int, num_decode_rows: int, seconds: float
    ) -> None:
        """A completed step and how long it took; only steps without prefill teach the cost of a draft."""
        if num_prefill_tokens == num_draft_tokens and num_decode_rows:
            self.cost.observe(num_decode_rows, num_draft_tokens, seconds)

    def threshold(self, num_rows: int) -> float:
        """The least probability a draft must have of being kept to pay for its token in a step of `num_rows`
        decoding sequences (module docstring)."""
        threshold = self.cost.threshold(max(1, num_rows))
        return DEFAULT_THRESHOLD if threshold is None else threshold

    def num_drafts(self, request_id: str, threshold: float) -> int:
        """How many drafts the sequence should verify in its next step, given the step's `threshold`."""
        if not self.adaptive:
            return self.max_drafts
        rates = self._rates.get(request_id)
        if rates is None:
            rates = self._rates[request_id] = _Rates(self.max_drafts)
        depth = rates.depth(threshold, self.max_drafts)
        if depth == 0:
            rates.idle_steps += 1
            if rates.idle_steps >= PROBE_EVERY:
                rates.idle_steps = 0
                depth = 1
        return depth

    def observe(self, request_id: str, num_drafts: int, num_kept: int) -> None:
        """A verified step of the sequence: `num_kept` of its `num_drafts` drafts were kept (a prefix of them)."""
        if num_drafts <= 0:
            return
        rates = self._rates.get(request_id)
        if rates is None:
            rates = self._rates[request_id] = _Rates(self.max_drafts)
        rates.observe(num_drafts, num_kept)

    def release(self, request_id: str) -> None:
        self._rates.pop(request_id, None)
