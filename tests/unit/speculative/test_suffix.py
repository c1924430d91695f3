"""SuffixProposer: copying passages, the bounds on a proposal, the shared cache of outputs, and agreement with a
brute-force reference that counts continuations by scanning the sequences."""

from __future__ import annotations

import random
from fractions import Fraction

from engine_server.speculative.suffix import SuffixProposer


def _propose(proposer: SuffixProposer, tokens: list[int], max_tokens: int = 100, request_id: str = "r") -> list[int]:
    return proposer.propose(request_id, tokens, max_tokens)


def _learn(proposer: SuffixProposer, request_id: str, prompt: list[int], output: list[int]) -> None:
    """A request seen by `propose` that ends with `output`."""
    proposer.propose(request_id, prompt, 1)
    proposer.finish(request_id, prompt + output, len(prompt))


def test_repeated_passage_is_proposed_back() -> None:
    passage = list(range(100, 120))
    tokens = [*passage, 7, 8, *passage[:3]]
    assert _propose(SuffixProposer(max_spec_factor=4.0), tokens, max_tokens=10) == list(range(103, 113))
    assert _propose(SuffixProposer(), tokens) == [103, 104, 105]  # a 3-token match proposes 3 tokens at most


def test_max_tokens_and_spec_factor_bound_the_length() -> None:
    passage = list(range(100, 150))
    tokens = [*passage, 1, *passage[:10]]
    assert _propose(SuffixProposer(), tokens, max_tokens=5) == list(range(110, 115))
    assert _propose(SuffixProposer(), tokens, max_tokens=100) == list(range(110, 120))
    assert _propose(SuffixProposer(max_spec_factor=0.5), tokens, max_tokens=100) == list(range(110, 115))
    assert _propose(SuffixProposer(max_spec_factor=0.01), tokens, max_tokens=100) == [110]  # at least one


def test_match_and_proposal_stay_within_the_tree_depth() -> None:
    passage = list(range(100, 150))
    tokens = [*passage, 1, *passage[:20]]
    # A 5-token match leaves room for 19 tokens (4 * 5 >= 19); a longer match leaves less, a shorter allows less.
    assert _propose(SuffixProposer(max_tree_depth=24, max_spec_factor=4.0), tokens) == list(range(120, 139))
    assert _propose(SuffixProposer(max_tree_depth=1), tokens) == []


def test_min_token_prob_stops_at_an_uncertain_branch() -> None:
    tokens = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 9, 1, 2, 3]  # 1 2 3 -> 4 always, then 5 or 6
    assert _propose(SuffixProposer(min_token_prob=0.6), tokens) == [4]
    assert _propose(SuffixProposer(min_token_prob=0.5), tokens) == [4, 6, 9]  # ties go to the latest occurrence
    uncertain = [1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 8, 9, 1, 2, 3]
    assert _propose(SuffixProposer(min_token_prob=0.6), uncertain) == []
    assert _propose(SuffixProposer(min_token_prob=0.5), uncertain) == [7, 8, 9]


def test_nothing_matching_proposes_nothing() -> None:
    proposer = SuffixProposer()
    assert _propose(proposer, [5]) == []
    assert _propose(proposer, [5, 6, 7, 8]) == []
    assert _propose(proposer, [1, 2, 3], max_tokens=0, request_id="other") == []


def test_incremental_growth_matches_building_from_scratch() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(4) for _ in range(400)]
    incremental = SuffixProposer(max_tree_depth=8, max_spec_factor=2.0)
    for end in range(1, len(tokens) + 1, 3):
        grown = _propose(incremental, tokens[:end], max_tokens=6)
        assert grown == _propose(SuffixProposer(max_tree_depth=8, max_spec_factor=2.0), tokens[:end], max_tokens=6)


def test_cache_proposes_an_earlier_requests_output() -> None:
    proposer = SuffixProposer()
    _learn(proposer, "a", [1, 2, 3], list(range(50, 70)))
    assert _propose(proposer, [90, 91, 50, 51, 52], request_id="b") == [53, 54, 55]
    assert _propose(proposer, [90, 91, 1, 2], request_id="c") == []  # prompts are not cached


def test_cache_eviction_forgets_the_oldest_request() -> None:
    proposer = SuffixProposer(max_cached_requests=2)
    for i in range(3):
        _learn(proposer, f"old{i}", [1], [10 * i + 200 + j for j in range(6)])
    assert _propose(proposer, [200, 201], request_id="new0") == []
    assert _propose(proposer, [210, 211], request_id="new1") == [212, 213]
    assert _propose(proposer, [220, 221], request_id="new2") == [222, 223]
    disabled = SuffixProposer(max_cached_requests=0)
    _learn(disabled, "a", [1], [5, 6, 7, 8])
    assert _propose(disabled, [5, 6], request_id="b") == []


def test_a_request_never_proposed_for_still_teaches_its_outputs() -> None:
    proposer = SuffixProposer()
    proposer.finish("unknown", [1, 2, 3, 4, 5], 1)  # the policy never asked it for drafts
    assert _propose(proposer, [2, 3], request_id="b") == [4, 5]
    proposer.finish("b", [2, 3], 2)  # no outputs: nothing to learn
    proposer.finish("b", [2, 3], 2)


def _continuations(seqs: list[list[int]], path: list[int], depth: int) -> dict[int, tuple[int, tuple[int, int]]]:
    """Token -> (occurrences of `path` + token within `depth` tokens, position of the latest one)."""
    found: dict[int, tuple[int, tuple[int, int]]] = {}
    if len(path) >= depth:
        return found
    for order, seq in enumerate(seqs):
        for start in range(len(seq) - len(path)):
            if seq[start : start + len(path)] == path:
                token = seq[start + len(path)]
                found[token] = (found.get(token, (0, (0, 0)))[0] + 1, (order, start + len(path)))
    return found


def _reference_walk(seqs: list[list[int]], path: list[int], limit: int, depth: int, min_prob: float) -> tuple:
    tokens: list[int] = []
    prob, score = Fraction(1), Fraction(0)
    while len(tokens) < limit:
        found = _continuations(seqs, path + tokens, depth)
        if not found:
            break
        token, (count, _) = max(found.items(), key=lambda item: item[1])
        total = sum(count for count, _ in found.values())
        if count / total < min_prob:
            break
        prob *= Fraction(count, total)
        score += prob
        tokens.append(token)
    return tokens, score


def _reference_choices(
    tokens: list[int], cache: list[list[int]], max_tokens: int, depth: int, factor: float, min_prob: float
) -> list[list[int]]:
    """The proposal the rule picks (the best expected acceptance; ties to the own sequence, then the longer match),
    then any whose score differs from it by float rounding only."""
    scored = []
    for seqs in ([tokens], cache):
        for match in range(min(depth - 1, len(tokens)), 0, -1):
            if _continuations(seqs, tokens[-match:], depth):
                limit = max(1, min(max_tokens, int(factor * match + 1e-9)))
                scored.append(_reference_walk(seqs, tokens[-match:], limit, depth, min_prob))
    best = max((score for _, score in scored), default=Fraction(0))
    if best == 0:
        return [[]]
    first = next(proposal for proposal, score in scored if score == best)
    return [first] + [proposal for proposal, score in scored if 0 < abs(score - best) < 1e-9]


def test_agrees_with_a_brute_force_reference() -> None:
    rng = random.Random(1)
    for depth, factor, min_prob, cached in ((5, 1.0, 0.1, 3), (8, 2.0, 0.3, 2), (24, 1.0, 0.0, 4)):
        proposer = SuffixProposer(
            max_tree_depth=depth, max_cached_requests=cached, max_spec_factor=factor, min_token_prob=min_prob
        )
        outputs: list[list[int]] = []
        for request in range(12):
            prompt = [rng.randrange(5) for _ in range(rng.randrange(1, 30))]
            tokens = list(prompt)
            for _ in range(rng.randrange(1, 40)):
                max_tokens = rng.randrange(1, 8)
                proposal = proposer.propose(str(request), tokens, max_tokens)
                choices = _reference_choices(tokens, outputs[-cached:], max_tokens, depth, factor, min_prob)
                assert proposal in choices, (tokens, outputs[-cached:], proposal, choices)
                tokens.extend(proposal[: rng.randrange(len(proposal) + 1)] or [rng.randrange(5)])
            proposer.finish(str(request), tokens, len(prompt))
            outputs.append(tokens[len(prompt) :])
