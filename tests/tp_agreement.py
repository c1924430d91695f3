"""How a tensor-parallel engine's greedy output is judged against TP=1's (the CPU end-to-end tests and the GPU
tests share it): float sums over the ranks round in another order, so a continuation may flip only where TP=1's
two best tokens nearly tie. A prompt agrees when its tokens are identical, or when at the first difference TP=1
had both tokens in its top 2 within NEAR_TIE_NATS of each other; at least IDENTICAL of the prompts must be
identical outright. Imports nothing beyond the engine's own, so a GPU machine without the gateway's packages runs
it."""

from __future__ import annotations

import random

from engine_server.frontend import Choice

NUM_PROMPTS = 32
NUM_TOKENS = 16
# Logits of these models span about +-30; float32 sums in another order move them by ~1e-5 relative (3e-4 nats):
# a flip needs the top two within about 1e-4 relative of each other.
NEAR_TIE_NATS = 3e-3
IDENTICAL = 0.95


def random_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 49152) for _ in range(rng.randrange(4, 40))] for _ in range(NUM_PROMPTS)]


def judge(got: list[list[str]], reference: list[Choice]) -> tuple[int, list[str]]:
    """(prompts identical, a line for each prompt that is not) for continuations given as token strings."""
    identical, problems = 0, []
    for index, (tokens, ref) in enumerate(zip(got, reference, strict=True)):
        assert ref.logprobs is not None
        ref_tokens = [lp.token for lp in ref.logprobs]
        first = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=False)) if a != b), None)
        if first is None and len(tokens) == len(ref_tokens):
            identical += 1
            continue
        if first is None:
            problems.append(f"prompt {index}: {len(tokens)} tokens against TP=1's {len(ref_tokens)}")
            continue
        top = {t.token: t.logprob for t in ref.logprobs[first].top_logprobs}
        gap = top[ref_tokens[first]] - top[tokens[first]] if tokens[first] in top else float("inf")
        verdict = "near-tie" if gap <= NEAR_TIE_NATS else "DIVERGED"
        problems.append(
            f"prompt {index}: {verdict} at token {first} ({tokens[first]!r} vs {ref_tokens[first]!r}, {gap:.2e} nats)"
        )
    return identical, problems


def assert_agree(got: list[list[str]], reference: list[Choice], what: str) -> None:
    identical, problems = judge(got, reference)
    report = f"{what}: {identical}/{NUM_PROMPTS} identical to TP=1\n" + "\n".join(problems)
    print(report)
    assert identical >= IDENTICAL * NUM_PROMPTS and not any(
        "DIVERGED" in p or "tokens against" in p for p in problems
    ), report
