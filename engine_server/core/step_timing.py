"""How long an engine step takes, learned from measured steps, and how much batch prefill fits a time target.

Why: an INTERACTIVE request that arrives while a step runs waits for that step to end (on the CPU a step of
BATCH work only is stopped for it, engine_server.step_interrupt; but not a step that carries INTERACTIVE rows too,
whose tokens a stream waits for, nor the BATCH step right after a stopped one, nor any step on CUDA). The
scheduler therefore sizes the BATCH work of each step so that the step's predicted time stays within a target,
and an arrival waits at most about one short step.

Contract:
- `StepTimeModel.observe(prefill_tokens, decode_rows, seconds)` feeds one measured step (the engine core times
  each `step()` call); steps that scheduled nothing are not fed.
- `predict(prefill_tokens, decode_rows)` is the expected seconds of a step with that work; None before the
  first measurement.
- `batch_prefill_cap(decode_rows)` is the most prefill tokens a step with `decode_rows` decode rows may carry
  so that its predicted time stays within `target_s`, but never less than `min_chunk`, so BATCH work always
  progresses; `min_chunk` before the first measurement.
- `decode_row_cap()` is the most decode rows a step may carry within `target_s` (at least 1); None (no cap)
  before the first measurement. `prefill_that_fits(decode_rows)`: the prefill tokens that fit beside them,
  possibly none.
- The model: seconds = overhead + per_token * (prefill_tokens + decode_rows) + row_premium * decode_rows,
  fitted by exponentially weighted least squares over the recent steps (the cost of a token drifts with the
  context it attends to and with the machine's load), with a weak ridge pulling overhead and row premium to 0:
  until the mix of the steps tells them apart, it is one rate per scheduled token.
- Surprises are taken asymmetrically. A step slower than `max_surprise` times its prediction counts as that
  much only, so one stalled step (another process took the CPU) moves the fit only so far. A step faster than
  its prediction by that factor means the past misleads (the first steps' lazy set-up, compiles, a stall that
  ended): the fit starts again from it, rather than forgetting the past over the next hundred steps.
Pure state, no clock: the caller measures. Not thread-safe: the engine core's thread owns it.
"""

from __future__ import annotations

import math

# The weak prior: worth about one step's evidence that there is no overhead, and no premium per decode
# row over a scale of `_ROW_SCALE` rows.
_RIDGE = 1.0
_ROW_SCALE = 32.0


# While no INTERACTIVE request has arrived or run for INTERACTIVE_QUIET_S seconds, BATCH steps may take the
# larger quiet target (QUIET_TARGET_FACTOR times a configured target): a batch alone runs in larger, cheaper steps,
# and the first arrival after a quiet spell (a person's next message) waits for at most one such step (0.15 s on
# the CPU); from then on every step keeps to the target.
INTERACTIVE_QUIET_S = 5.0
QUIET_TARGET_FACTOR = 3.0


def default_step_targets(configured: float | None, device_type: str) -> tuple[float, float]:
    """(target, quiet target) in seconds: the configured target and QUIET_TARGET_FACTOR times it, else by device.
    On the CPU a step's time grows with its decode rows (~1 ms each on 2 cores), so while INTERACTIVE requests are
    about BATCH steps keep to 0.015 s, rows included: the steps an arrival cannot stop (one with INTERACTIVE rows,
    the one after a stopped step) stay short, and so does an INTERACTIVE stream's time between tokens during a
    batch; alone, a batch takes 0.15 s steps.
    On a GPU a step is ~10x shorter and rows cost little: 0.02 s, 0.06 s quiet."""
    if configured is not None:
        return configured, configured * QUIET_TARGET_FACTOR
    return (0.02, 0.06) if device_type == "cuda" else (0.015, 0.15)


class StepTimeModel:
    """Online linear model of a step's seconds from its prefill tokens and decode rows (module docstring)."""

    def __init__(
        self, target_s: float, min_chunk: int = 64, decay: float = 0.95, max_surprise: float = 4.0,
        quiet_factor: float = QUIET_TARGET_FACTOR,
    ) -> None:
        if target_s <= 0 or min_chunk < 1 or not 0 < decay < 1 or max_surprise < 1 or quiet_factor < 1:
            raise ValueError("StepTimeModel needs target_s > 0, min_chunk >= 1, 0 < decay < 1, max_surprise >= 1, "
                             "quiet_factor >= 1")
        self.target_s = target_s
        self.quiet_target_s = target_s * quiet_factor  # the target while no INTERACTIVE request is about
        self.min_chunk = min_chunk
        self.decay = decay
        self.max_surprise = max_surprise
        self.num_observed = 0
        # Decayed sums over the features x = (1, tokens, decode rows): sum of x x^T and of x * seconds.
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self._coef: tuple[float, float, float] | None = None  # (overhead, per_token, row_premium)

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(overhead s, s per scheduled token, extra s per decode row); None before the first measurement."""
        return self._coef

    def predict(self, prefill_tokens: int, decode_rows: int) -> float | None:
        if self._coef is None:
            return None
        overhead, per_token, premium = self._coef
        return overhead + per_token * (prefill_tokens + decode_rows) + premium * decode_rows

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        tokens = prefill_tokens + decode_rows
        if tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        predicted = self.predict(prefill_tokens, decode_rows)
        if predicted is not None and seconds * self.max_surprise < predicted:
            self._xx = [[0.0] * 3 for _ in range(3)]
            self._xy = [0.0] * 3
        elif predicted is not None:
            seconds = min(seconds, predicted * self.max_surprise)
        x = (1.0, float(tokens), float(decode_rows))
        for i in range(3):
            self._xy[i] = self.decay * self._xy[i] + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = self.decay * self._xx[i][j] + x[i] * x[j]
        self.num_observed += 1
        self._coef = self._fit()

    def decode_row_cap(self, target_s: float | None = None) -> int | None:
        """The most decode rows (at least 1) a step without prefill may carry within `target_s` (default: the
        model's target); None (no cap) before the first measurement."""
        if self._coef is None:
            return None
        overhead, per_token, premium = self._coef
        spare = (self.target_s if target_s is None else target_s) - overhead
        return max(1, round(spare / (per_token + premium)))

    def prefill_that_fits(self, decode_rows: int, target_s: float | None = None) -> int:
        """Prefill tokens that fit `target_s` (default: the model's target) beside `decode_rows` decode rows,
        possibly 0 (no minimum chunk); 0 before the first measurement."""
        if self._coef is None:
            return 0
        spare = (self.target_s if target_s is None else target_s) - self.predict(0, decode_rows)  # type: ignore[operator]
        return max(0, round(spare / self._coef[1]))

    def batch_prefill_cap(self, decode_rows: int, target_s: float | None = None) -> int:
        """`prefill_that_fits`, but at least `min_chunk`."""
        return max(self.min_chunk, self.prefill_that_fits(decode_rows, target_s))

    def _fit(self) -> tuple[float, float, float]:
        ridge = (_RIDGE, 0.0, _RIDGE * _ROW_SCALE**2)
        a = [[self._xx[i][j] + (ridge[i] if i == j else 0.0) for j in range(3)] for i in range(3)]
        coef = _solve(a, self._xy)
        if coef is not None and coef[0] < 0:  # no step takes less than nothing: fit without the overhead
            sub = _solve([row[1:] for row in a[1:]], self._xy[1:])
            coef = None if sub is None else [0.0, *sub]
        if coef is None or coef[1] <= 0 or coef[1] + coef[2] <= 0:
            # The mix of the steps cannot support the terms yet: one rate per scheduled token.
            return (0.0, self._xy[1] / self._xx[1][1], 0.0)
        return (coef[0], coef[1], coef[2])


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve the small system a x = b by Gaussian elimination with partial pivoting; None if it is singular."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if not m[pivot][col]:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
