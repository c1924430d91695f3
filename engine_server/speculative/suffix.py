"""Suffix decoding proposals: the most frequent continuation of the sequence's end, in its own tokens and in the
outputs of recent requests (Oliaro et al., arXiv 2411.04975; vLLM's `method: "suffix"`).

Contract (engine_server.speculative.TokenProposer): `propose` returns at most `max_tokens` tokens likely to follow
`token_ids`, possibly none; between calls for one request id `token_ids` only grows at its end, and only the tokens
appended since the last call are indexed (a shorter `token_ids` starts the request over). `finish` drops the
request's state and, for a request `propose` has seen, adds its outputs (the tokens after the prompt) to a cache
shared by all requests; the outputs of only the latest `max_cached_requests` finished requests are kept (0 disables
the cache). Not thread-safe.

Structure: one suffix trie per request over its prompt and outputs, and one over the cached outputs. A trie holds
every substring of at most `max_tree_depth` tokens (for each start position, the path of the tokens that follow it,
cut at that depth); a node counts the occurrences of its path (`count`) and of its path followed by a token
(`total`, the sum of its children's counts), and keeps its most frequent child (ties: the one occurring latest, the
likelier source of a copy). A path that occurs once is not materialized: its parent's child entry is a reference
`seq_id << 32 | index` to the position of its last token, and the tokens after it are read from the stored sequence
(a suffix-tree-like path compression). Each new token extends the materialized paths of the last `max_tree_depth`
start positions kept in a cursor list.

Proposal: every suffix of the sequence of m < max_tree_depth tokens that occurred before (in either trie) is a
candidate. From its node the walk takes the most frequent child while that child's probability (its count over
the node's `total`) is at least `min_token_prob`, for at most min(max_tokens, floor(max_spec_factor * m)) tokens
(at least 1) and while match plus proposal stay within `max_tree_depth` tokens. The proposal with the largest
expected number of accepted tokens (the sum over its tokens of the product of the probabilities up to each) wins;
ties go to the request's own trie, then to the longer match. Considering every match length, not only the longest,
is what lets a long copied passage be proposed max_tree_depth / (1 + max_spec_factor) tokens at a time instead of
the one token the depth bound leaves after a match of max_tree_depth - 1 tokens.

Costs, with D = max_tree_depth: indexing a token is O(number of materialized paths among the last D starts), so
O(D) at worst (highly repetitive text) and O(1) for text that rarely repeats; a proposal looks at the up to D - 1
cursor nodes of its own trie and walks from the root for up to D - 1 suffixes in the shared one (O(D^2) dict
lookups at worst, far fewer in practice since a candidate that cannot beat the best so far is skipped). Memory per
trie: the tokens (one int each), one child entry per distinct substring first occurring once, and one node (~200
bytes with its dict) per substring that occurs at least twice: O(tokens * D) at worst, O(tokens) for text that
rarely repeats. `finish` costs O(output tokens * D) at worst to add the outputs and as much to evict the oldest.
Measured in CPython for a 2,000-token request growing by one token a call: a few microseconds a proposal for text
that rarely repeats, ~50 us while copying its prompt, ~30-60 us with 1,000 cached outputs; about 130 bytes a token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

_INDEX_BITS = 32
_INDEX_MASK = (1 << _INDEX_BITS) - 1
_STALE = 1 << 62  # `best_count` of a node whose best child is unknown after an eviction: no count reaches it


class _Node:
    """A path that occurred at least twice (or, after evictions in the shared trie, once), or the root."""

    __slots__ = ("best_count", "best_token", "children", "count", "depth", "stamp", "total")

    def __init__(self, depth: int, count: int, stamp: int) -> None:
        self.depth = depth  # tokens on the path
        self.count = count  # occurrences of the path
        self.stamp = stamp  # position (seq_id << 32 | index) of the last token of its latest occurrence
        self.total = 0  # occurrences followed by a token: the sum of the children's counts (a reference counts 1)
        self.children: dict[int, _Node | int] = {}  # token -> node, or reference to a path occurring once
        self.best_token = -1
        self.best_count = 0

    def count_child(self, token: int, count: int) -> None:
        """Child `token` now occurs `count` times, the latest one: it is the best child unless another occurs more
        often (so the best is the child with the largest (count, stamp))."""
        if count >= self.best_count:
            self.best_token, self.best_count = token, count

    def refresh_best(self) -> None:
        best = (0, -1)
        for token, child in self.children.items():
            key = (child.count, child.stamp) if isinstance(child, _Node) else (1, child)
            if key > best:
                best, self.best_token = key, token
        self.best_count = best[0]


class _SuffixTrie:
    """The substrings of at most `max_depth` tokens of the sequences in `seqs`, with counts."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(0, 0, -1)
        self.seqs: dict[int, list[int]] = {}

    def extend(self, cursors: list[_Node], seq_id: int, start: int) -> list[_Node]:
        """Index the tokens of `seqs[seq_id]` from `start` on. `cursors` (longest path first) are the materialized
        nodes of the paths `seq[s:start]` that may still grow; the same for the new end is returned."""
        seq = self.seqs[seq_id]
        for index in range(start, len(seq)):
            token = seq[index]
            grown: list[_Node] = []
            for node in cursors:
                child = self._step(node, token, seq_id, index)
                if child is not None and child.depth < self.max_depth:
                    grown.append(child)
            child = self._step(self.root, token, seq_id, index)
            if child is not None and child.depth < self.max_depth:
                grown.append(child)
            cursors = grown
        return cursors

    def _step(self, node: _Node, token: int, seq_id: int, index: int) -> _Node | None:
        """Count `token` (at `index` of sequence `seq_id`) after `node`'s path; the child's node if materialized."""
        node.total += 1
        position = seq_id << _INDEX_BITS | index
        child = node.children.get(token)
        if child is None:
            node.children[token] = position
            node.count_child(token, 1)
            return None
        if isinstance(child, _Node):
            child.count += 1
            child.stamp = position
            node.count_child(token, child.count)
            return child
        # The path occurred once before: materialize it, its earlier occurrence continuing as a reference.
        grown = node.children[token] = _Node(node.depth + 1, 2, position)
        other = self.seqs[child >> _INDEX_BITS]
        follower = (child & _INDEX_MASK) + 1
        if grown.depth < self.max_depth and follower < len(other):
            grown.children[other[follower]] = child + 1
            grown.total = 1
            grown.count_child(other[follower], 1)
        node.count_child(token, 2)
        return grown

    def remove(self, seq_id: int) -> None:
        """Uncount every substring of sequence `seq_id` and forget it."""
        seq = self.seqs.pop(seq_id)
        for start in range(len(seq)):
            node = self.root
            for index in range(start, min(start + self.max_depth, len(seq))):
                token = seq[index]
                node.total -= 1
                child = node.children[token]
                if token == node.best_token:
                    node.best_count = _STALE
                if isinstance(child, int) or child.count == 1:  # this occurrence was the path's last one
                    del node.children[token]
                    break
                child.count -= 1
                node = child

    def locate(self, context: list[int], start: int) -> _Node | tuple[list[int], int, int] | None:
        """Where `context[start:]` occurs: its node, or (sequence, index of its follower, end of the stored path)
        when it occurs once; None when it does not occur."""
        node = self.root
        for index in range(start, len(context)):
            child = node.children.get(context[index])
            if child is None:
                return None
            if isinstance(child, _Node):
                node = child
                continue
            seq, follower, end = self._path(node, child)
            rest = len(context) - index - 1
            if follower + rest > end or seq[follower : follower + rest] != context[index + 1 :]:
                return None
            return seq, follower + rest, end
        return node

    def _path(self, parent: _Node, reference: int) -> tuple[list[int], int, int]:
        """The sequence a child reference of `parent` points into, the index after the referenced token, and the
        end of the stored path (`max_depth` tokens from its start, at most the sequence's end)."""
        seq = self.seqs[reference >> _INDEX_BITS]
        index = reference & _INDEX_MASK
        return seq, index + 1, min(index - parent.depth + self.max_depth, len(seq))

    def walk(self, node: _Node, limit: int, min_prob: float) -> tuple[list[int], float]:
        """Up to `limit` tokens following `node`'s path, each the most frequent child while its probability is at
        least `min_prob`, and their expected number of accepted tokens."""
        tokens: list[int] = []
        score, prob = 0.0, 1.0
        while len(tokens) < limit and node.total:
            if node.best_count == _STALE:
                node.refresh_best()
            step_prob = node.best_count / node.total
            if step_prob < min_prob:
                break
            prob *= step_prob
            token = node.best_token
            child = node.children[token]
            tokens.append(token)
            score += prob
            if isinstance(child, _Node):
                node = child
                continue
            seq, follower, end = self._path(node, child)  # a path occurring once: each next token has probability 1
            more = seq[follower : min(end, follower + limit - len(tokens))]
            tokens.extend(more)
            score += prob * len(more)
            break
        return tokens, score


class _RequestState:
    """One request's trie over its own tokens (sequence 0) and the cursors at its end."""

    __slots__ = ("cursors", "tokens", "trie")

    def __init__(self, max_depth: int) -> None:
        self.trie = _SuffixTrie(max_depth)
        self.tokens: list[int] = []
        self.trie.seqs[0] = self.tokens
        self.cursors: list[_Node] = []

    def append(self, token_ids: Sequence[int]) -> None:
        start = len(self.tokens)
        if len(token_ids) > start:
            self.tokens.extend(token_ids[start:])
            self.cursors = self.trie.extend(self.cursors, 0, start)


class SuffixProposer:
    """Proposes by suffix decoding; implements engine_server.speculative.TokenProposer."""

    def __init__(
        self,
        *,
        max_tree_depth: int = 24,
        max_cached_requests: int = 1000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        if max_tree_depth < 1 or max_cached_requests < 0:
            raise ValueError("max_tree_depth must be >= 1, max_cached_requests >= 0")
        if max_spec_factor <= 0 or not 0 <= min_token_prob < 1:
            raise ValueError("max_spec_factor must be > 0, min_token_prob in [0, 1)")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._requests: dict[str, _RequestState] = {}
        self._cache = _SuffixTrie(max_tree_depth)
        self._cached_ids: deque[int] = deque()  # oldest first
        self._next_seq_id = 0

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        state = self._requests.get(request_id)
        if state is None or len(token_ids) < len(state.tokens):  # a shorter sequence is a new one
            state = self._requests[request_id] = _RequestState(self.max_tree_depth)
        state.append(token_ids)
        best: list[int] = []
        best_score = 0.0
        if max_tokens < 1:
            return best
        for node in state.cursors:  # the suffixes that occurred before, longest first
            limit = self._limit(node.depth, max_tokens)
            if min(limit, self.max_tree_depth - node.depth) > best_score:
                tokens, score = state.trie.walk(node, limit, self.min_token_prob)
                if score > best_score:
                    best, best_score = tokens, score
        if not self._cache.seqs:
            return best
        context = state.tokens
        for match in range(min(self.max_tree_depth - 1, len(context)), 0, -1):
            limit = self._limit(match, max_tokens)
            if min(limit, self.max_tree_depth - match) <= best_score:
                continue
            where = self._cache.locate(context, len(context) - match)
            if isinstance(where, _Node):
                tokens, score = self._cache.walk(where, limit, self.min_token_prob)
            elif where is not None:
                seq, follower, end = where
                tokens = seq[follower : min(end, follower + limit)]
                score = float(len(tokens))
            else:
                continue
            if score > best_score:
                best, best_score = tokens, score
        return best

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._requests.pop(request_id, None)
        # Learned even when it was never proposed for (its policy found drafts not worth it): its outputs still teach.
        if self.max_cached_requests == 0 or len(token_ids) <= num_prompt_tokens:
            return
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        self._cache.seqs[seq_id] = list(token_ids[num_prompt_tokens:])
        self._cache.extend([], seq_id, 0)
        self._cached_ids.append(seq_id)
        while len(self._cached_ids) > self.max_cached_requests:
            self._cache.remove(self._cached_ids.popleft())

    def _limit(self, match: int, max_tokens: int) -> int:
        """The most tokens a match of `match` tokens may propose: at least 1."""
        return max(1, min(max_tokens, int(self.max_spec_factor * match + 1e-9)))
