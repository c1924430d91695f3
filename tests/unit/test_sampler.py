"""The batched sampler: each parameter's effect on crafted logits, seeding, distributions and logprobs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import pytest
import torch

from engine_server.sampling import Sampler, SamplingRow, logits_transforms
from engine_server.sampling_params import SamplingParams

V = 16
EOS = 0


def make_row(
    params: SamplingParams | None = None,
    *,
    prompt: Sequence[int] = (1, 2, 3),
    output: Sequence[int] = (),
    seed: int | None = None,
    bitmask: torch.Tensor | None = None,
) -> SamplingRow:
    return SamplingRow(
        params=params or SamplingParams(),
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        eos_token_ids=frozenset({EOS}),
        position=len(prompt) + len(output),
        seed=seed,
        allowed_token_bitmask=bitmask,
    )


def random_logits(batch: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def repeated(probs: Sequence[float], batch: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(batch, -1).contiguous()


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


GREEDY = SamplingParams(temperature=0.0)


def test_greedy_is_argmax_and_leaves_logits_untouched() -> None:
    logits = random_logits(5)
    before = logits.clone()
    out = Sampler(V, "cpu")(logits, [make_row(GREEDY) for _ in range(5)])
    assert out.token_ids.dtype == torch.int64
    assert out.token_id_list() == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_token_ids is None
    assert torch.equal(logits, before)


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(32)
    out = Sampler(V, "cpu", seed=1)(logits, [make_row(SamplingParams(top_k=1)) for _ in range(32)])
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_small_top_p_keeps_only_the_top_token() -> None:
    logits = random_logits(32)
    rows = [make_row(SamplingParams(top_p=0.01, temperature=1.5)) for _ in range(32)]
    assert torch.equal(Sampler(V, "cpu", seed=2)(logits, rows).token_ids, logits.argmax(-1))


def test_mixed_batch_greedy_rows_stay_greedy() -> None:
    logits = random_logits(8)
    params = [GREEDY, SamplingParams(temperature=1.0)] * 4
    out = Sampler(V, "cpu", seed=3)(logits, [make_row(p) for p in params])
    assert out.token_ids[0::2].tolist() == logits[0::2].argmax(-1).tolist()


PROBS = [0.5, 0.3, 0.15, 0.05]
N_DRAWS = 20000


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), PROBS),
        (SamplingParams(temperature=2.0), [math.sqrt(p) for p in PROBS]),
        (SamplingParams(top_k=2), [0.5, 0.3, 0.0, 0.0]),
        (SamplingParams(top_p=0.75), [0.5, 0.3, 0.0, 0.0]),
        (SamplingParams(top_p=0.9), [0.5, 0.3, 0.15, 0.0]),
        (SamplingParams(min_p=0.5), [0.5, 0.3, 0.0, 0.0]),  # threshold 0.25
        (SamplingParams(min_p=0.2), [0.5, 0.3, 0.15, 0.0]),  # threshold 0.1
        (SamplingParams(top_k=3, top_p=0.7, temperature=0.5), [0.25, 0.09, 0.0, 0.0]),
    ],
)
def test_sampling_frequencies_match_the_filtered_distribution(params: SamplingParams, expected: list[float]) -> None:
    want = torch.tensor(expected) / sum(expected)
    rows = [make_row(params) for _ in range(N_DRAWS)]
    got = frequencies(Sampler(4, "cpu", seed=4)(repeated(PROBS, N_DRAWS), rows).token_ids, 4)
    assert torch.allclose(got, want, atol=0.015), (got, want)
    assert torch.all(got[want == 0] == 0)


def test_top_k_without_sort_agrees_with_the_sort_path() -> None:
    logits = random_logits(6, vocab=64)
    top_k = torch.tensor([1, 3, 64, 10, 5, 64])
    fast = logits_transforms.apply_top_k(logits, top_k, k_max=10)
    sorted_path = logits_transforms.apply_top_k_top_p(logits, top_k, None)
    assert torch.equal(fast, sorted_path)
    assert (fast[1] > float("-inf")).sum() == 3 and (fast[2] > float("-inf")).all()


def test_top_p_from_candidates_agrees_with_the_sort_path() -> None:
    """Top-p alone on the CPU reads each row's most likely tokens; rows whose nucleus reaches past them (a flat
    row, top_p 1.0) take the sort, so every row keeps exactly the sorted path's tokens."""
    vocab = 4 * logits_transforms.NUCLEUS_CANDIDATES
    logits = random_logits(8, vocab=vocab) * 4  # peaked rows: their nucleus is among the candidates
    logits[5] = torch.randn(vocab, generator=torch.Generator().manual_seed(9)) * 0.01  # flat: it is not
    logits[6, : vocab // 2] = float("-inf")  # masked by a grammar
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.1, 0.95, 0.9, 0.8, 1.0])
    fast = logits_transforms.apply_top_k_top_p(logits, None, top_p)
    sorted_path = logits_transforms._sorted_top_k_top_p(logits, None, top_p)
    assert torch.equal(fast > float("-inf"), sorted_path > float("-inf"))
    assert torch.equal(fast[fast > float("-inf")], logits[fast > float("-inf")])
    kept = (fast > float("-inf")).sum(-1)
    assert kept[5] > logits_transforms.NUCLEUS_CANDIDATES and kept[7] == vocab and kept[3] >= 1


def test_large_top_k_takes_the_sort_path() -> None:
    vocab = 2048
    logits = random_logits(64, vocab=vocab)
    rows = [make_row(SamplingParams(top_k=1500 if i % 2 else 1)) for i in range(64)]
    out = Sampler(vocab, "cpu", seed=5)(logits, rows)
    assert torch.equal(out.token_ids[0::2], logits[0::2].argmax(-1))
    ranks = (logits > logits.gather(1, out.token_ids.unsqueeze(1))).sum(-1)
    assert (ranks < 1500).all()


def test_repetition_penalty_hand_computed() -> None:
    logits = torch.zeros(1, V)
    logits[0, 1], logits[0, 2], logits[0, 4] = 2.0, -1.0, 3.0
    row = make_row(SamplingParams(repetition_penalty=2.0), prompt=[1], output=[2, 2])
    got = Sampler(V, "cpu").process_logits(logits, [row])
    want = logits.clone()
    want[0, 1], want[0, 2] = 1.0, -2.0  # positive divided, negative multiplied; token 4 unseen
    assert torch.equal(got, want)


def test_presence_frequency_count_output_tokens_only() -> None:
    logits = random_logits(1)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    row = make_row(params, prompt=[7, 7], output=[3, 3, 5])
    got = Sampler(V, "cpu").process_logits(logits, [row])
    want = logits.clone()
    want[0, 3] -= 0.5 + 2 * 0.25
    want[0, 5] -= 0.5 + 0.25
    assert torch.allclose(got, want)


def test_penalties_on_a_subset_of_rows_match_each_row_alone() -> None:
    logits = random_logits(4)
    rows = [
        make_row(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7), output=[4, 5, 4]),
        make_row(output=[4, 5]),
        make_row(SamplingParams(presence_penalty=-1.0), prompt=[9], output=[9, 1]),
        make_row(SamplingParams(repetition_penalty=0.5), prompt=[6]),
    ]
    sampler = Sampler(V, "cpu")
    batched = sampler.process_logits(logits, rows)
    for i, row in enumerate(rows):
        assert torch.allclose(batched[i], sampler.process_logits(logits[i : i + 1], [row])[0])
    assert torch.equal(batched[1], logits[1])


def test_logit_bias_forces_and_forbids_tokens() -> None:
    logits = random_logits(16)
    top = logits.argmax(-1)
    sampler = Sampler(V, "cpu", seed=6)
    forced = sampler(logits, [make_row(SamplingParams(logit_bias={7: 100.0})) for _ in range(16)])
    assert forced.token_id_list() == [7] * 16
    rows = [make_row(SamplingParams(temperature=0.0, logit_bias={int(t): -100.0})) for t in top]
    forbidden = sampler(logits, rows)
    assert not torch.any(forbidden.token_ids == top)


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 9], logits[0, 4] = 10.0, 9.0, 8.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(9,))
    sampler = Sampler(V, "cpu")
    assert sampler(logits, [make_row(params, output=[])]).token_id_list() == [4]
    assert sampler(logits, [make_row(params, output=[5])]).token_id_list() == [4]
    assert sampler(logits, [make_row(params, output=[5, 6])]).token_id_list() == [EOS]


def test_ignore_eos_leaves_eos_samplable_during_min_tokens() -> None:
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 9], logits[0, 4] = 10.0, 11.0, 8.0
    params = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=(9,))
    assert Sampler(V, "cpu")(logits, [make_row(params)]).token_id_list() == [EOS]


def test_grammar_bitmask_restricts_tokens() -> None:
    vocab = 40  # two 32-bit words; the second covers tokens 32..39
    allowed = {3, 33}
    mask = torch.zeros(2, dtype=torch.int32)
    for t in allowed:
        mask[t // 32] |= 1 << (t % 32)
    logits = random_logits(200, vocab=vocab)
    rows = [make_row(bitmask=mask if i % 2 == 0 else None) for i in range(200)]
    out = Sampler(vocab, "cpu", seed=7)(logits, rows).token_ids
    assert set(out[0::2].tolist()) == allowed
    assert len(set(out[1::2].tolist()) - allowed) > 0


def test_allowed_token_ids_restrict_tokens_alone_and_beside_a_grammar() -> None:
    """vLLM's allowed_token_ids: sampled and greedy rows take only those tokens (token 31, the sign bit, and one in
    the second word included); beside a grammar's mask, only what both allow; other rows are untouched."""
    vocab = 40
    allowed = SamplingParams(allowed_token_ids=(3, 31, 33))
    grammar = torch.zeros(2, dtype=torch.int32)
    for t in (31, 33, 35):
        grammar[t // 32] |= 1 << (t % 32)
    logits = random_logits(300, vocab=vocab)
    rows = [make_row(allowed if i % 3 else None, bitmask=grammar if i % 3 == 2 else None) for i in range(300)]
    out = Sampler(vocab, "cpu", seed=7)(logits, rows).token_ids
    assert set(out[1::3].tolist()) == {3, 31, 33}
    assert set(out[2::3].tolist()) == {31, 33}
    assert len(set(out[0::3].tolist()) - {3, 31, 33}) > 0
    greedy = dataclasses.replace(allowed, temperature=0.0)
    picked = Sampler(vocab, "cpu")(logits[:4], [make_row(greedy)] * 4).token_id_list()
    masked = torch.full_like(logits[:4], float("-inf"))
    masked[:, [3, 31, 33]] = logits[:4, [3, 31, 33]]
    assert picked == masked.argmax(dim=-1).tolist()


def test_bad_words_hold_a_words_last_token_where_the_output_ends_with_the_rest() -> None:
    """vLLM's bad_words rule: a one-token word is never sampled; a longer word's last token is not, right after the
    output ends with its other tokens (greedy rows whose argmax is that token take the next best)."""
    from engine_server.sampling.metadata import bad_word_bans

    words = ((5,), (7, 8, 9))
    assert sorted(bad_word_bans(words, [])) == [5]
    assert sorted(bad_word_bans(words, [1, 7, 8])) == [5, 9]
    assert sorted(bad_word_bans(words, [7, 8, 1])) == [5]
    logits = torch.zeros(3, V)
    logits[:, 9] = 5.0
    logits[:, 5] = 4.0
    logits[:, 6] = 3.0
    params = SamplingParams(temperature=0.0, bad_word_token_ids=words)
    rows = [make_row(params, output=out) for out in ([1, 7, 8], [7, 8, 1], [])]
    assert Sampler(V, "cpu")(logits, rows).token_id_list() == [6, 9, 9]


def test_sign_bit_of_the_bitmask_is_token_31() -> None:
    mask = torch.tensor([-(2**31)], dtype=torch.int32)  # only bit 31 set
    logits = random_logits(1, vocab=32)
    out = Sampler(32, "cpu")(logits, [make_row(GREEDY, bitmask=mask)])
    assert out.token_id_list() == [31]


def test_padded_vocab_columns_are_never_sampled() -> None:
    logits = torch.cat([random_logits(3), torch.full((3, 4), 1e4)], dim=1)
    out = Sampler(V, "cpu")(logits, [make_row(GREEDY), make_row(), make_row(SamplingParams(top_k=3))])
    assert (out.token_ids < V).all()


def run_steps(rows_for_step: list[SamplingRow], sampler: Sampler, seeded_index: int, steps: int) -> list[int]:
    """Sample `steps` tokens, feeding each one back into the seeded row's output (penalties see it)."""
    logits_gen = torch.Generator().manual_seed(123)
    rows = list(rows_for_step)
    tokens: list[int] = []
    for _ in range(steps):
        step_logits = torch.randn(1, V, generator=logits_gen)
        logits = random_logits(len(rows), seed=len(tokens))
        logits[seeded_index] = step_logits[0]
        token = sampler(logits, rows).token_id_list()[seeded_index]
        tokens.append(token)
        row = rows[seeded_index]
        rows[seeded_index] = dataclasses.replace(
            row, output_token_ids=[*row.output_token_ids, token], position=row.position + 1
        )
    return tokens


def test_seeded_row_is_reproducible_alone_or_in_any_batch() -> None:
    params = SamplingParams(temperature=1.3, top_p=0.95, frequency_penalty=0.3, seed=42)
    alone = run_steps([make_row(params, seed=42)], Sampler(V, "cpu", seed=0), 0, steps=8)
    others = [
        make_row(GREEDY),
        make_row(SamplingParams(top_k=3), seed=7),
        make_row(SamplingParams(temperature=0.7, min_p=0.1)),
        make_row(SamplingParams(repetition_penalty=1.2), output=[1, 2]),
        make_row(SamplingParams(logit_bias={5: 3.0}, logprobs=True, top_logprobs=3)),
        make_row(SamplingParams(top_p=0.5, presence_penalty=1.0), output=[4]),
        make_row(SamplingParams(min_tokens=4)),
        make_row(SamplingParams(top_k=2, temperature=1.5), seed=43),
    ]
    batch = [*others[:3], make_row(params, seed=42), *others[3:]]
    together = run_steps(batch, Sampler(V, "cpu", seed=99), 3, steps=8)
    assert together == alone
    other_seed = run_steps([make_row(params, seed=41)], Sampler(V, "cpu", seed=0), 0, steps=8)
    assert other_seed != alone  # 8 draws over 16 tokens: a collision would be astronomically unlikely


def test_logprobs_are_raw_and_top_logprobs_sorted() -> None:
    logits = random_logits(3)
    rows = [
        make_row(SamplingParams(logprobs=True, top_logprobs=4, temperature=0.5, top_k=2)),
        make_row(SamplingParams(logprobs=True)),
        make_row(),
    ]
    out = Sampler(V, "cpu", seed=8)(logits, rows)
    raw = logits.log_softmax(-1)
    assert out.logprobs is not None and out.top_logprobs is not None and out.top_token_ids is not None
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    assert out.top_token_ids.shape == (3, 4)
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    assert torch.allclose(out.top_logprobs, raw.gather(1, out.top_token_ids))
    assert out.top_token_ids[:, 0].tolist() == logits.argmax(-1).tolist()
    first, second, third = out.logprob_list()
    assert first is not None and second is not None and third is None
    assert len(first.top) == 4 and second.top == ()
    assert [t for t, _ in first.top] == out.top_token_ids[0].tolist()
    assert first.token_id == out.token_id_list()[0]
    assert first.logprob == pytest.approx(raw[0, first.token_id].item())


def test_logprobs_do_not_change_the_greedy_tokens() -> None:
    logits = random_logits(6)
    plain = Sampler(V, "cpu")(logits, [make_row(GREEDY) for _ in range(6)])
    with_lp = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    traced = Sampler(V, "cpu")(logits, [make_row(with_lp) for _ in range(6)])
    assert torch.equal(plain.token_ids, traced.token_ids)
    assert all(lp is None for lp in plain.logprob_list())


def test_empty_batch_and_shape_mismatch() -> None:
    sampler = Sampler(V, "cpu")
    assert sampler(torch.zeros(0, V), []).token_ids.shape == (0,)
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, V), [make_row()])
    with pytest.raises(ValueError):
        sampler(torch.zeros(1, V - 1), [make_row()])


def test_argmax_alone_equals_the_greedy_rows_of_a_full_call() -> None:
    logits = torch.cat([random_logits(4), torch.full((4, 3), 1e4)], dim=1)  # a padded lm_head's extra columns
    sampler = Sampler(V, "cpu")
    fast = sampler.argmax(logits)
    assert fast.token_id_list() == sampler(logits, [make_row(GREEDY) for _ in range(4)]).token_id_list()
    assert fast.token_ids.dtype == torch.int64 and fast.logprobs is None and (fast.token_ids < V).all()
    with pytest.raises(ValueError, match="vocab"):
        sampler.argmax(logits[:, : V - 1])


def test_argmax_alone_takes_the_first_of_tied_maxima_and_a_nan_as_torch_argmax_does() -> None:
    # The CPU takes max(dim).indices (faster); it must pick what argmax picks.
    logits = torch.randint(0, 3, (64, V)).float()
    logits[5, 7] = float("nan")
    logits[9, [2, V - 1]] = float("inf")
    assert torch.equal(Sampler(V, "cpu").argmax(logits).token_ids, logits.argmax(-1))
