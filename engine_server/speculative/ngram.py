"""Prompt-lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of the sequence's end.

For n from `max_n` down to `min_n`, the last n tokens are looked up among the sequence's earlier n-grams (prompt
and outputs alike); the first n that matches proposes the tokens that followed its most recent earlier
occurrence (continued periodically past the end, for an occurrence only a few tokens back: a loop). The most
recent one, because in the work this pays for (editing a passage, quoting the input) the answer walks through its
source in order: after a change, the text the answer is copying lies just past the last place it matched.

Cost: an index per request and n-gram size, from an n-gram (a tuple) to the position that followed its latest
occurrence, extended by the tokens appended since the last call: O(max_n - min_n + 1) dict updates per new token
and as many lookups per proposal; memory O(tokens x sizes) per request, dropped in `finish`.
"""

from __future__ import annotations

from collections.abc import Sequence


class _Index:
    """One request's n-gram positions: `latest[n][gram]` is the index of the token that followed the latest
    occurrence of `gram` (n tokens) among the first `length` tokens, excluding the occurrence ending the sequence."""

    __slots__ = ("latest", "length")

    def __init__(self, sizes: range) -> None:
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.length = 0


class NgramProposer:
    """Proposes by prompt lookup; implements engine_server.speculative.TokenProposer."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.sizes = range(max_n, min_n - 1, -1)  # the longest match first
        self._indexes: dict[str, _Index] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _Index(self.sizes)
        self._extend(index, token_ids)
        length = len(token_ids)
        for n in self.sizes:
            if n > length:
                continue
            follower = index.latest[n].get(tuple(token_ids[length - n :]))
            if follower is not None:
                return _continuation(token_ids, follower, max_tokens)
        return []

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._indexes.pop(request_id, None)

    def _extend(self, index: _Index, token_ids: Sequence[int]) -> None:
        """Index every n-gram that now has a follower: the ones ending before each token appended since last time."""
        for end in range(max(index.length, 1), len(token_ids)):  # `end`: the follower's index
            for n in self.sizes:
                if n <= end:
                    index.latest[n][tuple(token_ids[end - n : end])] = end
        index.length = max(index.length, len(token_ids))


def _continuation(token_ids: Sequence[int], follower: int, count: int) -> list[int]:
    """`count` tokens from `follower` on. Past the sequence's end the text is taken to go on repeating with the
    match's period (the distance from the earlier occurrence to the end), as a loop in the output does: so a match
    a few tokens back still proposes `count` tokens, not just the few before the end."""
    proposal = list(token_ids[follower : follower + count])
    period = len(token_ids) - follower
    while len(proposal) < count:
        proposal.append(proposal[len(proposal) - period])
    return proposal
