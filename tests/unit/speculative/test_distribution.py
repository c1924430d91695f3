"""Sampled outputs with speculation follow the target's distribution, not just "run": a chi-square test.

The target is a Markov chain over 4 tokens (fixed logits per previous token), sampled by the engine's own
sampler (temperature 1, the shared generator: no seed) and verified by the engine's own rule (`accepted_run`):
every position a step verifies is sampled with the drafts before it as its history, and the drafts are kept
while they equal those samples. The drafts are deterministic and often wrong (a fixed guess), so refusals,
corrections and the token after a fully kept run all occur. 20,000 sequences of 3 tokens each must be
distributed as the chain says: a chi-square statistic over the 64 outcomes below the 0.1% critical value.
A verifier that, say, kept a refused draft's position or resampled from the wrong history fails it by far.
"""

from __future__ import annotations

import itertools
import math

import torch

from engine_server.sampling import Sampler, SamplingRow
from engine_server.sampling_params import SamplingParams
from engine_server.speculative.verify import accepted_run

VOCAB = 4
LENGTH = 3
SEQUENCES = 20_000
CHI2_CRITICAL_63_DF_0_001 = 103.44  # the 99.9% quantile of chi-square with 63 degrees of freedom


def _chain() -> torch.Tensor:
    """[VOCAB, VOCAB]: row p is the distribution of the token after token p."""
    probs = torch.tensor(
        [[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.1, 0.2], [0.25, 0.25, 0.25, 0.25], [0.05, 0.05, 0.3, 0.6]],
        dtype=torch.float64,
    )
    return probs


def _speculative_samples(drafts_for: list[int], seed: int, misaligned: bool = False) -> list[tuple[int, ...]]:
    """SEQUENCES runs of the chain from token 0, LENGTH tokens each, drawn by verifying `drafts_for` every step.
    `misaligned`: a broken verifier that samples every position from the logits of the row's last known token."""
    probs = _chain()
    log_probs = probs.log().float()
    sampler = Sampler(VOCAB, "cpu", seed=seed)
    params = SamplingParams(temperature=1.0, max_tokens=LENGTH)
    sequences: list[list[int]] = [[0] for _ in range(SEQUENCES)]
    while True:
        open_rows = [s for s in sequences if len(s) <= LENGTH]
        if not open_rows:
            break
        drafts = [drafts_for[: LENGTH + 1 - len(s) - 1] for s in open_rows]
        rows: list[SamplingRow] = []
        logits: list[torch.Tensor] = []
        for sequence, draft in zip(open_rows, drafts, strict=True):
            history = [sequence[-1], *draft]
            for j in range(len(draft) + 1):
                rows.append(SamplingRow(params, [0], sequence[1:] + draft[:j], frozenset(), len(sequence) + j))
                logits.append(log_probs[history[0 if misaligned else j]])
        tokens = sampler(torch.stack(logits), rows).token_id_list()
        row = 0
        for sequence, draft in zip(open_rows, drafts, strict=True):
            sequence.extend(accepted_run(draft, tokens[row : row + len(draft) + 1]))
            row += len(draft) + 1
    return [tuple(s[1 : LENGTH + 1]) for s in sequences]


def _chi_square(samples: list[tuple[int, ...]]) -> float:
    probs = _chain()
    counts: dict[tuple[int, ...], int] = {}
    for sample in samples:
        counts[sample] = counts.get(sample, 0) + 1
    statistic = 0.0
    for outcome in itertools.product(range(VOCAB), repeat=LENGTH):
        p, previous = 1.0, 0
        for token in outcome:
            p *= float(probs[previous, token])
            previous = token
        expected = p * len(samples)
        statistic += (counts.get(outcome, 0) - expected) ** 2 / expected
    return statistic


def test_speculative_sampling_follows_the_target_distribution() -> None:
    for seed, guess in enumerate([[0, 0], [1, 1], [3, 3], [2, 0]]):
        statistic = _chi_square(_speculative_samples(guess, seed))
        assert statistic < CHI2_CRITICAL_63_DF_0_001, (guess, statistic)


def test_a_verifier_sampling_from_the_wrong_position_is_caught() -> None:
    """The test's own power: verifying each draft against the logits of the wrong position (off by one draft, a
    plausible indexing bug) is far outside the bound."""
    statistic = _chi_square(_speculative_samples([1, 1], 7, misaligned=True))
    assert math.isfinite(statistic) and statistic > 10 * CHI2_CRITICAL_63_DF_0_001
