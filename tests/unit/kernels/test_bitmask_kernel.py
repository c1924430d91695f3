"""The Triton grammar bitmask against `ladle_kernels.reference.apply_token_bitmask_` (xgrammar's int32 layout)."""

from __future__ import annotations

import pytest
import torch

from ladle_kernels import reference
from ladle_kernels.bitmask import apply_token_bitmask_

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "vocab", "extra_words"), [(1, 32, 0), (3, 100, 0), (7, 2049, 1), (2, 5000, 0)])
def test_bitmask_matches_reference(
    device: torch.device, dtype: torch.dtype, rows: int, vocab: int, extra_words: int
) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(device, dtype)
    width = -(-vocab // 32) + extra_words  # bits past the vocab are ignored
    # Every bit pattern, sign bit included (int32 words are signed).
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, width), generator=gen, dtype=torch.int32).to(device)
    expected = logits.clone()
    reference.apply_token_bitmask_(expected, bitmask)
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits, expected)


def test_bitmask_on_strided_rows_keeps_other_columns(device: torch.device) -> None:
    base = torch.randn(3, 80, generator=torch.Generator().manual_seed(7)).to(device)
    logits = base[:, :70]
    bitmask = torch.zeros(3, 3, dtype=torch.int32, device=device)
    bitmask[1] = -1  # row 1 allows everything
    expected = base.clone()
    expected[[0, 2], :70] = float("-inf")
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(base, expected)


def test_bitmask_rejects_a_narrow_mask(device: torch.device) -> None:
    with pytest.raises(ValueError, match="bitmask width"):
        apply_token_bitmask_(torch.randn(1, 65, device=device), torch.zeros(1, 2, dtype=torch.int32, device=device))
