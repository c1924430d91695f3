"""Counter-based noise of seeded rows: its definition, its bounds, its distribution, and the race it drives.

The statistical tests are deterministic (fixed seeds); their thresholds are the 1e-4 upper quantiles of the
statistics, so a correct implementation passes them and a biased or correlated one fails by a wide margin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from engine_server.sampling import Sampler, SamplingMetadata, SamplingRow, noise
from engine_server.sampling_params import SamplingParams
from ladle_kernels.reference import SPLITMIX_GOLDEN, SPLITMIX_MIX_1, SPLITMIX_MIX_2

MASK64 = (1 << 64) - 1
Z_1E4 = 3.719  # the standard normal's 1e-4 upper quantile
PROBS = [0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02]


def chi2_limit(df: int) -> float:
    """The chi-square distribution's 1e-4 upper quantile (Wilson-Hilferty: within 1% for df >= 3)."""
    return df * (1 - 2 / (9 * df) + Z_1E4 * math.sqrt(2 / (9 * df))) ** 3


def chi2(observed: np.ndarray, expected: np.ndarray) -> float:
    return float(((observed - expected) ** 2 / expected).sum())


def log_uniforms(seeds: Sequence[int], positions: Sequence[int], vocab: int) -> torch.Tensor:
    keys = torch.from_numpy(noise.row_keys(seeds, positions))
    return noise.SeededNoise(vocab, torch.device("cpu")).log_uniforms(keys)


def seeded_row(params: SamplingParams, seed: int, position: int) -> SamplingRow:
    return SamplingRow(params, [1, 2], [], frozenset(), position=position, seed=seed)


def test_device_noise_is_its_plain_python_definition() -> None:
    seeds = [0, 1, 2, 41, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
    positions = [0, 1, 7, 100, 5, 2**20, 3, 131071]
    got = log_uniforms(seeds, positions, 3000)
    for row, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        for token in (0, 1, 2, 1024, 2047, 2999):
            assert got[row, token].item() == pytest.approx(math.log(noise.uniform(seed, position, token)), rel=1e-6)


def unmix64(x: int) -> int:
    """The inverse of SplitMix64's output function: mix64(unmix64(x)) == x."""

    def unxorshift(y: int, shift: int) -> int:
        z = y
        for _ in range(64 // shift + 1):
            z = y ^ (z >> shift)
        return z

    x = unxorshift(x, 31)
    x = unxorshift((x * pow(SPLITMIX_MIX_2, -1, 1 << 64)) & MASK64, 27)
    return unxorshift((x * pow(SPLITMIX_MIX_1, -1, 1 << 64)) & MASK64, 30)


def test_extreme_draws_stay_strictly_inside_zero_and_one() -> None:
    """Keys built (by inverting mix64) so that token 5 draws the lowest and the highest of the 2**23 values."""
    token = 5
    tops = {0x400000: 2.0**-24, 0x3FFFFF: 1 - 2.0**-24}  # s = -2**22 and s = 2**22 - 1 (signed top 23 bits)
    keys = [(unmix64(top << 41) - SPLITMIX_GOLDEN * token) & MASK64 for top in tops]
    keys_i64 = torch.tensor([k - (1 << 64) if k >= 1 << 63 else k for k in keys], dtype=torch.int64)
    got = noise.SeededNoise(16, torch.device("cpu")).log_uniforms(keys_i64)[:, token]
    assert got.tolist() == pytest.approx([math.log(u) for u in tops.values()], rel=1e-6)
    assert (got < 0).all() and torch.isfinite(got).all()  # E = -log(u) is positive and finite: u is never 0 nor 1


def test_uniforms_are_uniform_and_independent_across_tokens_seeds_and_positions() -> None:
    seeds = np.arange(64).repeat(4).tolist()  # adjacent seeds: choice i of an n > 1 request has seed + i
    positions = np.tile(np.arange(4), 64).tolist()  # adjacent positions: consecutive tokens of one request
    u = log_uniforms(seeds, positions, 4096).exp().double().numpy()
    assert u.min() > 0 and u.max() < 1
    flat = np.sort(u.reshape(-1))
    n = flat.size
    ks = np.max(np.maximum(np.arange(1, n + 1) / n - flat, flat - np.arange(n) / n))
    assert ks < 2.15 / math.sqrt(n)  # Kolmogorov-Smirnov at 1e-4
    counts = np.bincount((flat * 1024).astype(np.int64), minlength=1024)
    assert chi2(counts, np.full(1024, n / 1024)) < chi2_limit(1023)
    # Pairs in a 16 x 16 grid: next token, next position (same seed), next seed (same position).
    by_row = u.reshape(64, 4, 4096)
    pairs = {
        "token": (by_row[:, :, :-1], by_row[:, :, 1:]),
        "position": (by_row[:, :-1, :], by_row[:, 1:, :]),
        "seed": (by_row[:-1], by_row[1:]),
    }
    for name, (a, b) in pairs.items():
        cells = (a * 16).astype(np.int64) * 16 + (b * 16).astype(np.int64)
        grid = np.bincount(cells.reshape(-1), minlength=256)
        assert chi2(grid, np.full(256, cells.size / 256)) < chi2_limit(255), name


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(seed=0), PROBS),
        (SamplingParams(temperature=0.5, top_p=0.8, seed=0), [p * p for p in PROBS[:3]] + [0.0] * 5),
    ],
)
def test_the_race_picks_each_token_with_its_probability(params: SamplingParams, expected: list[float]) -> None:
    """20,000 seeded rows (adjacent seeds, one position) and one seed over 20,000 positions, each a chi-square fit."""
    n = 20000
    logits = torch.tensor(PROBS).log().expand(n, -1).contiguous()
    want = np.array(expected) / sum(expected)
    sampler = Sampler(len(PROBS), "cpu", seed=0)
    for rows in (
        [seeded_row(params, seed, 3) for seed in range(n)],
        [seeded_row(params, 12345, position) for position in range(n)],
    ):
        counts = np.bincount(sampler(logits, rows).token_ids.numpy(), minlength=len(PROBS))
        kept = want > 0
        assert (counts[~kept] == 0).all()
        assert chi2(counts[kept], n * want[kept]) < chi2_limit(int(kept.sum()) - 1), counts


def test_consecutive_tokens_of_one_seed_and_choices_of_adjacent_seeds_are_independent() -> None:
    """Joint counts of (token at p, token at p+1) for one seed, and (seed s, seed s+1) at one position, against
    the product of the marginals: a correlation between neighbours would show as a misfit of the 8 x 8 grid."""
    n = 20000
    logits = torch.tensor(PROBS).log().expand(n + 1, -1).contiguous()
    sampler = Sampler(len(PROBS), "cpu", seed=0)
    along_positions = sampler(logits, [seeded_row(SamplingParams(), 77, p) for p in range(n + 1)]).token_ids
    along_seeds = sampler(logits, [seeded_row(SamplingParams(), s, 9) for s in range(n + 1)]).token_ids
    want = np.outer(PROBS, PROBS).reshape(-1) * n
    for tokens in (along_positions.numpy(), along_seeds.numpy()):
        grid = np.bincount(tokens[:-1] * len(PROBS) + tokens[1:], minlength=len(PROBS) ** 2)
        assert chi2(grid, want) < chi2_limit(len(PROBS) ** 2 - 1)


def test_a_seeded_token_depends_only_on_its_seed_position_and_logits() -> None:
    """The same row alone, among unseeded and greedy rows (the mixed path), in another sampler, at another
    index: one token. Another position, or another seed, draws anew."""
    vocab = 64
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    tokens = []
    for position in range(40):
        row = seeded_row(params, 5, position)
        alone = Sampler(vocab, "cpu", seed=1)(logits, [row]).token_id_list()[0]
        greedy = seeded_row(SamplingParams(temperature=0.0), 0, 0)  # a greedy row's seed is not used
        unseeded = SamplingRow(SamplingParams(), [1], [], frozenset(), position=3)  # the shared generator
        others = [greedy, unseeded]
        batch = torch.cat([logits.expand(2, -1) * 0.5, logits])
        mixed = Sampler(vocab, "cpu", seed=2)(batch, [*others, row]).token_id_list()[2]
        assert mixed == alone
        tokens.append(alone)
    assert len(set(tokens)) > 5  # positions draw different noise
    other_seed = [Sampler(vocab, "cpu")(logits, [seeded_row(params, 6, p)]).token_id_list()[0] for p in range(40)]
    assert other_seed != tokens


def test_metadata_at_later_positions_equals_a_fresh_build() -> None:
    """A steady batch reuses its metadata from step to step; only the seeded rows' keys follow the positions."""
    params = [SamplingParams(temperature=0.7, seed=5), SamplingParams(temperature=0.0), SamplingParams(top_p=0.9)]
    seeds = [5, None, None]

    def rows(positions: Sequence[int]) -> list[SamplingRow]:
        return [
            SamplingRow(p, [1, 2], [], frozenset(), position=pos, seed=seed)
            for p, pos, seed in zip(params, positions, seeds, strict=True)
        ]

    device = torch.device("cpu")
    first = SamplingMetadata.build(rows([4, 9, 2]), 64, device)
    later, fresh = first.at_positions([7, 10, 3], device), SamplingMetadata.build(rows([7, 10, 3]), 64, device)
    assert later.seeded is not None and fresh.seeded is not None
    assert later.seeded.keys.tolist() == fresh.seeded.keys.tolist() != first.seeded.keys.tolist()
    assert later.seeded.row_indices == fresh.seeded.row_indices == (0,)
    for name in ("temperature", "top_p", "greedy_mask"):
        assert getattr(later, name).tolist() == getattr(fresh, name).tolist(), name
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(64, device, seed=1)
    assert sampler.sample(logits, later).token_ids[0] == sampler.sample(logits, fresh).token_ids[0]
    unseeded = SamplingMetadata.build(rows([1, 1, 1])[1:], 64, device)
    assert unseeded.at_positions([2, 2], device) is unseeded  # nothing to redo
