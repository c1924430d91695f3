"""A null device for a ModelRunner: the forward and the sampler's math replaced by O(1) stand-ins.

What is left of a step is host work: scheduling, KV blocks, input building, the sampler's per-row metadata,
output handling. The stand-ins are attributes of one runner, set by `null_device` and put back on exit:

- the model: `forward` returns zeros `[T, 1]`, `compute_logits` returns them as the logits;
- the sampler: `argmax` (the runner's path for a batch of plain greedy rows) returns fixed token ids per row;
  `__call__` still builds the step's `SamplingMetadata` from the rows, as the real sampler does, then returns
  the same fixed ids;
- a `DeviceClock`, when it has a step time: each launched step occupies the device that long after it was
  launched (steps run one after another, like kernels queued on one stream), and `collect` sleeps (releasing
  the GIL) until the step is done, as a host waiting on a GPU would. With async scheduling the next step is
  launched before the previous one is collected, so a step then costs about max(host, device) instead of
  host + device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks.step_probes import replaced, wrapped
from engine_server.model_runner import LaunchedStep, ModelRunner
from engine_server.sampling import Sampler, SamplerOutput, SamplingRow
from engine_server.sampling.metadata import SamplingMetadata

# Ordinary vocabulary tokens (SmolLM2's ids 1000-1999 are word pieces), so detokenizing them is typical work.
FIRST_TOKEN_ID = 1000
TOKEN_ID_SPAN = 1000


class NullModel(torch.nn.Module):
    """A model whose forward does no work: one zero per token, which are also the logits."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Any,
        meta: Any,
        interrupt: Any = None,
        lora: Any = None,
    ) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 1, device=input_ids.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class NullSampler(Sampler):
    """Row i of a step gets token FIRST_TOKEN_ID + i % TOKEN_ID_SPAN; the rows' metadata is still built (by the
    runner, which hands it to `sample`)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__(vocab_size, device, seed=0)
        self._token_ids = self._table(1)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        return self.sample(logits, SamplingMetadata.build(rows, self.vocab_size, self.device))

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        return self._tokens(logits.shape[0])

    def argmax(self, logits: torch.Tensor) -> SamplerOutput:
        return self._tokens(logits.shape[0])

    def _tokens(self, count: int) -> SamplerOutput:
        if count > self._token_ids.shape[0]:
            self._token_ids = self._table(2 * count)
        return SamplerOutput(token_ids=self._token_ids[:count])

    def _table(self, size: int) -> torch.Tensor:
        return FIRST_TOKEN_ID + torch.arange(size, dtype=torch.int64, device=self.device) % TOKEN_ID_SPAN


class DeviceClock:
    """A device that runs each launched step for `step_s` seconds, one step after another.

    `step_s` may be changed between runs (0: no device time at all). Wrap a runner's `launch` with `launch`
    and its `collect` with `collect`.
    """

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self._busy_until = 0.0
        self._done_at: dict[int, float] = {}  # id(LaunchedStep) -> when the device finishes it

    def launch(self, launch: Callable[[Any, Any], LaunchedStep]) -> Callable[[Any, Any], LaunchedStep]:
        def timed(output: Any, interrupt: Any = None) -> LaunchedStep:
            step = launch(output, interrupt)
            if self.step_s > 0 and not output.is_empty:
                self._busy_until = max(time.perf_counter(), self._busy_until) + self.step_s
                self._done_at[id(step)] = self._busy_until
            return step

        return timed

    def collect(self, collect: Callable[[LaunchedStep], Any]) -> Callable[[LaunchedStep], Any]:
        def waiting(step: LaunchedStep) -> Any:
            done_at = self._done_at.pop(id(step), None)
            if done_at is not None:
                wait = done_at - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
            return collect(step)

        return waiting


@contextlib.contextmanager
def null_device(runner: ModelRunner, clock: DeviceClock | None = None) -> Iterator[None]:
    """`runner` runs on the null device (its step time from `clock`, else none) while the block runs.

    Use it while nothing steps the runner, or before the thread that does starts.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(replaced(runner, "model", NullModel()))
        stack.enter_context(replaced(runner, "sampler", NullSampler(runner.sampler.vocab_size, runner.device)))
        # The decode graphs (CUDA) replay the real model: the null forward must run instead.
        stack.enter_context(replaced(runner, "decode_graphs", None))
        if clock is not None:
            stack.enter_context(wrapped(runner, "launch", clock.launch))
            stack.enter_context(wrapped(runner, "collect", clock.collect))
        yield
