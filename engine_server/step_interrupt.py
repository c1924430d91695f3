"""Stopping a running CPU step between two layers, so that an INTERACTIVE arrival does not wait for a BATCH step.

On the CPU a step runs synchronously inside `ModelRunner.launch`; a request that arrives meanwhile waits for it
to end, however short the scheduler keeps BATCH steps (engine_server.core.step_timing). With a `StepInterrupt`,
another thread (the server's event loop, on an INTERACTIVE submission) sets a flag that the forward reads after
each layer; once set, the forward raises `StepInterrupted` and the engine core undoes the step's scheduling
(`Scheduler.undo`), so its work is scheduled again later from the same state: nothing it computed is kept but the
K/V of the layers it ran, which only its own requests' slots hold and which the step's rerun overwrites before
anything reads it. The arrival then waits about one layer instead of half a step.

Contract: `set` may be called from any thread at any time; `clear` and `is_set` belong to the thread that runs
steps. The flag is one int32 in a CPU tensor (`tensor`, which the C++ decode stack reads without the GIL) with a
numpy view for Python's reads and writes, which dispatch no torch op.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class StepInterrupted(Exception):
    """The step's forward stopped between two layers because its `StepInterrupt` was set; nothing was sampled."""


class StepInterrupt:
    """A flag that stops a running step between two layers (module docstring)."""

    def __init__(self) -> None:
        self.tensor = torch.zeros(1, dtype=torch.int32)
        self._view: np.ndarray[Any, np.dtype[np.int32]] = self.tensor.numpy()

    def set(self) -> None:
        """Ask the step that runs (or the next interruptible one) to stop after its current layer."""
        self._view[0] = 1

    def clear(self) -> None:
        self._view[0] = 0

    def is_set(self) -> bool:
        return bool(self._view[0])
