"""Small builders for core tests: requests, schedulers, and a fake runner that checks the KV layout."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine_server.config import CacheConfig, SchedulerConfig
from engine_server.core.request import Priority, Request
from engine_server.core.scheduler import Scheduler
from engine_server.core.scheduler_output import SchedulerOutput
from engine_server.core.step_timing import StepTimeModel
from engine_server.sampling_params import SamplingParams

VOCAB = 1000


def make_request(
    request_id: str,
    prompt: Sequence[int] | int,
    *,
    max_tokens: int | None = 8,
    min_tokens: int = 0,
    eos: Iterable[int] = (),
    stop_token_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
    priority: Priority = Priority.INTERACTIVE,
    arrival_time: float = 0.0,
    deadline: float | None = None,
    max_model_len: int = 4096,
) -> Request:
    """A request; an int `prompt` means that many distinct tokens seeded by the request id."""
    if isinstance(prompt, int):
        base = sum(map(ord, request_id)) * 7
        prompt = [(base + i) % VOCAB for i in range(prompt)]
    params = SamplingParams(
        max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos
    )
    return Request(
        request_id,
        prompt,
        params,
        max_model_len=max_model_len,
        eos_token_ids=eos,
        priority=priority,
        arrival_time=arrival_time,
        deadline=deadline,
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_waiting: int = 100,
    max_model_len: int = 4096,
    enable_prefix_caching: bool = True,
    step_time: StepTimeModel | None = None,
    state_slots: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, max_waiting=max_waiting
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        step_time=step_time,
        state_slots=state_slots,
    )


def next_token(tokens: Sequence[int]) -> int:
    """A deterministic stand-in for a model: the next token depends on the whole sequence."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + len(tokens)) % VOCAB


class FakeRunner:
    """Plays the model runner: writes each chunk's token ids into a fake KV pool, then, for every
    request that samples, checks that its block table holds exactly its tokens at every position.

    This catches wrong prefix-cache hits, blocks shared across requests after divergence, stale
    blocks after preemption, and positions skipped or computed twice.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.kv: dict[tuple[int, int], int] = {}  # (block id, slot) -> token id written there
        # Of the last step, when it verified drafts: per sampling row, the tokens the fake model keeps (the drafts
        # that equal its own tokens, then its token at the first difference), as `update_from_output` takes them.
        self.runs: list[list[int]] | None = None

    def step(self, output: SchedulerOutput) -> list[int]:
        """The step's sampled tokens, one per `needs_sample` row in order (as `update_from_output` takes them);
        a row with drafts writes them after its known tokens, and `runs` holds what it keeps."""
        bs = self.block_size
        # The counts the scheduler keeps as it goes agree with the rows themselves.
        assert output.num_batched_tokens == sum(item.num_new_tokens for item in output.scheduled)
        assert output.num_decode_rows == sum(1 for item in output.scheduled if not item.is_prefill)
        assert output.num_prefill_tokens == sum(
            item.num_new_tokens if item.is_prefill else len(item.draft_token_ids) for item in output.scheduled
        )
        assert output.num_draft_tokens == sum(len(item.draft_token_ids) for item in output.scheduled)
        # All writes of a step land before any read, as on the device.
        for item in output.scheduled:
            tokens = [*item.request.all_token_ids, *item.draft_token_ids]
            for pos in range(item.start_position, item.start_position + item.num_new_tokens):
                self.kv[(item.block_ids[pos // bs], pos % bs)] = tokens[pos]
        sampled: list[int] = []
        runs: list[list[int]] = []
        for item in output.scheduled:
            end = item.start_position + item.num_new_tokens
            seen = [self.kv.get((item.block_ids[p // bs], p % bs)) for p in range(end)]
            expected = [*item.request.all_token_ids, *item.draft_token_ids][:end]
            assert seen == expected, f"KV mismatch for {item.request_id}"
            if item.needs_sample:
                run = _fake_run(item.request.all_token_ids, item.draft_token_ids)
                sampled.append(run[-1])
                runs.append(run)
        self.runs = runs if output.num_draft_tokens else None
        return sampled


def _fake_run(tokens: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The fake model's tokens after `tokens` for as long as they equal `drafts`, and one more."""
    run: list[int] = []
    for draft in drafts:
        run.append(next_token([*tokens, *run]))
        if run[-1] != draft:
            return run
    run.append(next_token([*tokens, *run]))
    return run


def run_until_done(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> list[Request]:
    """Drive schedule -> fake runner -> update until nothing is left; returns requests in finish order."""
    finished: list[Request] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return finished
        output = scheduler.schedule(now=0.0)
        finished.extend(output.finished)
        tokens = runner.step(output)
        finished.extend(scheduler.update_from_output(output, tokens, runner.runs))
    raise AssertionError("requests did not finish")


def expected_output(prompt: Sequence[int], num_tokens: int) -> list[int]:
    """What an undisturbed run of the fake model generates after `prompt`."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]
