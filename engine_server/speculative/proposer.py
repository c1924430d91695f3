"""The host proposers' interface, and the one an engine's speculative configuration asks for."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine_server.config import SpeculativeConfig


class TokenProposer(Protocol):
    """Proposes the tokens likely to follow a sequence, from token ids alone, on the host. Not thread-safe: the
    engine core's thread owns it."""

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """At most `max_tokens` (>= 1) tokens likely to follow `token_ids`, the request's prompt then its outputs;
        possibly none. Between calls for one `request_id`, `token_ids` only grows at its end (a proposer may index
        it incrementally)."""
        ...

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The request ended with `token_ids` (its first `num_prompt_tokens` are the prompt): forget its state (an
        unknown id has none). A proposer that learns across requests keeps what its outputs teach, proposed for or
        not."""
        ...


def make_token_proposer(config: SpeculativeConfig) -> TokenProposer | None:
    """The host proposer for `config`; None for a draft model, which proposes on the runner's device."""
    if config.method == "ngram":
        from engine_server.speculative.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from engine_server.speculative.suffix import SuffixProposer

        return SuffixProposer(
            max_tree_depth=config.suffix_decoding_max_tree_depth,
            max_cached_requests=config.suffix_decoding_max_cached_requests,
            max_spec_factor=config.suffix_decoding_max_spec_factor,
            min_token_prob=config.suffix_decoding_min_token_prob,
        )
    return None
