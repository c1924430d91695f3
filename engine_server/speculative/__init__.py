"""Speculative decoding: draft tokens proposed on the host (or by a draft model) and verified by the target model.

A decoding sequence's step carries its last token and up to k proposed ones; the runner samples the target's
token at every one of those positions, exactly as k+1 ordinary steps would, and keeps the proposed tokens while
they equal the target's samples, plus the target's token at the first difference (or after the last proposal).
So the output is the one decoding without speculation gives: token for token for greedy and seeded requests,
in distribution for the others (for a deterministic proposal, keeping it while it equals an exact sample of the
target is the standard rejection rule: accepted with probability p(draft), else a sample of p without it).
"""

from engine_server.speculative.proposer import TokenProposer, make_token_proposer

__all__ = ["TokenProposer", "make_token_proposer"]
