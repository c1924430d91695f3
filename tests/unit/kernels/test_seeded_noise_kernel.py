"""The Triton counter-based noise against `ladle_kernels.reference.seeded_log_uniforms` (SplitMix64 in int64 torch
ops)."""

from __future__ import annotations

import pytest
import torch

from ladle_kernels import reference
from ladle_kernels.seeded_noise import seeded_log_uniforms

# Keys over the whole int64 range (every uint64 bit pattern, the sign bit included).
EDGE_KEYS = [0, 1, -1, 2**63 - 1, -(2**63), 0x5DEECE66D, -0x61C8864680B583EB]


@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 100), (7, 1025), (2, 5000)])
def test_kernel_matches_reference(device: torch.device, rows: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    random_keys = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen, dtype=torch.int64).tolist()
    keys = torch.tensor((EDGE_KEYS + random_keys)[: max(rows, 1)], dtype=torch.int64, device=device)
    tokens = torch.arange(vocab, device=device)
    expected = reference.seeded_log_uniforms(keys, tokens)
    got = seeded_log_uniforms(keys, tokens)
    assert got.shape == (keys.shape[0], vocab) and got.dtype == torch.float32
    assert (got < 0).all() and torch.isfinite(got).all()
    # The integers and u are exact in both; only the logs may round apart (by an ulp or so).
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_kernel_takes_any_token_ids_and_strided_keys(device: torch.device) -> None:
    base = torch.tensor(EDGE_KEYS * 2, dtype=torch.int64, device=device)
    keys = base[::2]  # a strided view
    tokens = torch.randperm(3000, generator=torch.Generator().manual_seed(3)).to(device)[:777]
    torch.testing.assert_close(
        seeded_log_uniforms(keys, tokens), reference.seeded_log_uniforms(keys, tokens), rtol=1e-6, atol=1e-7
    )


def test_kernel_rejects_other_dtypes_and_handles_empty_batches(device: torch.device) -> None:
    with pytest.raises(ValueError, match="int64"):
        seeded_log_uniforms(torch.zeros(2, dtype=torch.int32, device=device), torch.arange(4, device=device))
    empty = seeded_log_uniforms(torch.zeros(0, dtype=torch.int64, device=device), torch.arange(4, device=device))
    assert empty.shape == (0, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_sampler_takes_the_kernel_on_cuda() -> None:
    from engine_server.sampling import Sampler, SamplingRow
    from engine_server.sampling.noise import SeededNoise
    from engine_server.sampling_params import SamplingParams

    assert SeededNoise(100, torch.device("cuda"))._kernel is seeded_log_uniforms
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(SamplingParams(), [1], [], frozenset(), position=5, seed=s) for s in range(4)]
    on_gpu = Sampler(100, "cuda")(logits.cuda(), rows).token_id_list()
    assert on_gpu == Sampler(100, "cpu")(logits, rows).token_id_list()  # a log may round apart: rarely a token
