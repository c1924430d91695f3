"""Beam search (`SamplingParams.beam_width` > 1), as transformers' `generate(num_beams=..., do_sample=False)` runs it.

The engine keeps no beams: each step, every running beam is one request of its own (the prompt's and the beam's
tokens, one token out) whose top log-probabilities are its candidates (`step_params`); the prefix cache serves what
the beams share, so a step prefills each beam's last, unfinished block and its new token. `BeamSearch` turns the
candidates into the next step's beams and the finished ones, step for step as transformers' `_beam_search` does
(its float32 arithmetic, its `early_stopping` heuristic and its length penalty over the generated length), so on the
float path the answers are transformers' token for token. `beam_result` writes the n best as a result's choices
through the request's own `RequestTracker` (stop tokens, text, reasoning and tool calls read as for any choice).

Beam search is greedy: temperature, top_p, top_k, min_p and seed are not used. What would change the scores is
refused by name (`refusal`): penalties, logit_bias, allowed_token_ids, bad_words, stop strings, constraints, prompt
log-probabilities, images and clips. The drivers are `ServingEngine._generate_beams` (served) and
`LLM._generate_beams` (offline).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_server.core.engine_core import CoreOutput
from engine_server.core.request import RequestStatus
from engine_server.errors import ValidationError
from engine_server.model_runner import SampledToken
from engine_server.sampling.sampler import TokenLogprobs
from engine_server.sampling_params import MAX_BEAM_CANDIDATES, SamplingParams

_UNREACHABLE = -1.0e9  # transformers' score for a beam that may not be chosen (added, in float32, as it adds it)


Candidates = Sequence[tuple[int, float]]  # a beam's step: (token id, raw log-probability), most likely first


@dataclass(frozen=True)
class Beam:
    """A beam's generated tokens, and for each the candidates of the step that chose it."""

    token_ids: tuple[int, ...] = ()
    steps: tuple[Candidates, ...] = ()

    def extended(self, token_id: int, step: Candidates) -> Beam:
        return Beam((*self.token_ids, token_id), (*self.steps, step))


@dataclass(frozen=True)
class FinishedBeam:
    """A beam that ended: on one of the stop tokens (`stop_token_id`) or at the length cap (None), with its score (its
    summed log-probabilities over its length ** the length penalty)."""

    beam: Beam
    score: float
    stop_token_id: int | None


def refusal(params: SamplingParams, stop_ids: Sequence[int]) -> None:
    """Raise ValidationError (named by its parameter) where `params` ask beam search with something it does not
    serve; `stop_ids` are the tokens that end a beam (the model's end tokens, unless ignore_eos, and stop_token_ids)."""
    if params.beam_width == 1:
        return
    unserved = {
        "presence_penalty": params.presence_penalty != 0.0, "frequency_penalty": params.frequency_penalty != 0.0,
        "repetition_penalty": params.repetition_penalty != 1.0, "logit_bias": bool(params.logit_bias),
        "stop": bool(params.stop), "response_format": params.constraint is not None,
        "prompt_logprobs": params.prompt_logprobs is not None,
        "allowed_token_ids": params.allowed_token_ids is not None, "bad_words": bool(params.bad_words),
    }  # fmt: skip
    for name, asked in unserved.items():
        if asked:
            raise ValidationError(f"{name} is not served with beam search (beam_width {params.beam_width})", name)
    if candidates(params.beam_width, len(stop_ids)) > MAX_BEAM_CANDIDATES:
        raise ValidationError(f"beam search keeps (1 + stop tokens) x beam_width candidates a step, at most "
                              f"{MAX_BEAM_CANDIDATES}: {len(stop_ids)} stop tokens are too many for beam_width "
                              f"{params.beam_width}", "stop_token_ids")  # fmt: skip


def candidates(width: int, num_stop_ids: int) -> int:
    """How many continuations a step keeps (transformers' `beams_to_keep`): enough that `width` of them go on even
    where the best ones all end on a stop token."""
    return max(2, 1 + num_stop_ids) * width


def step_params(params: SamplingParams, search: BeamSearch) -> SamplingParams:
    """The parameters of a step's requests (one per running beam): one greedy token, its `search.wanted` best raw
    log-probabilities (the candidates; a stop token's among them is dropped while the beams are under min_tokens)."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=search.wanted,
                          skip_special_tokens=params.skip_special_tokens, beam_step=True)  # fmt: skip


class BeamSearch:
    """One request's beam search state. `running` are the beams to extend next (each one request of the step);
    `advance` takes their candidates; once `done`, `best` are the answers.

    `width` beams run; `stop_ids` end a beam (it is finished with its stop token); `max_new_tokens` ends every beam
    (the length cap); no stop token ends a beam before `min_new_tokens`. Scores follow transformers: the running beams'
    summed raw log-probabilities in float32, a finished one's divided by its length (its stop token counted) **
    `length_penalty`; `early_stopping` True ends the search once `width` beams finished, False when no running beam
    can beat the worst of them at its present length (transformers' heuristic)."""

    def __init__(
        self,
        width: int,
        stop_ids: Sequence[int],
        max_new_tokens: int,
        min_new_tokens: int = 0,
        length_penalty: float = 1.0,
        early_stopping: bool = False,
    ) -> None:
        self.width = width
        self.stop_ids = frozenset(stop_ids)
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.kept = candidates(width, len(self.stop_ids))
        self.running: list[Beam] = [Beam()]  # transformers' other first beams score -1e9: never chosen
        self._running_scores = torch.zeros(1, dtype=torch.float32)
        self._finished: list[FinishedBeam | None] = [None] * width
        self._finished_scores = torch.full((width,), _UNREACHABLE, dtype=torch.float32)
        self._improvable = True
        self.length = 0  # tokens each running beam holds
        self.done = False

    @property
    def wanted(self) -> int:
        """How many top log-probabilities each running beam's request asks: the kept candidates, and room for the stop
        tokens that are dropped while the beams are under min_new_tokens."""
        return self.kept + (len(self.stop_ids) if self.length < self.min_new_tokens else 0)

    def advance(self, found: Sequence[Candidates]) -> None:
        """Take each running beam's candidates (its request's top log-probabilities, in `running`'s order: at least
        `wanted` of them, or the whole vocabulary) and make the next
        running beams and the finished ones, as one iteration of transformers' beam search loop."""
        assert len(found) == len(self.running) and not self.done, "one step per running beam, until done"
        banned = self.stop_ids if self.length < self.min_new_tokens else frozenset()
        parents: list[int] = []
        tokens: list[int] = []
        scores: list[torch.Tensor] = []
        for index, step in enumerate(found):
            tops = [(token, logprob) for token, logprob in step if token not in banned][: self.kept]
            parents += [index] * len(tops)
            tokens += [token for token, _ in tops]
            scores.append(torch.tensor([logprob for _, logprob in tops], dtype=torch.float32)
                          + self._running_scores[index])  # fmt: skip
        accumulated = torch.cat(scores)
        top_scores, order = torch.topk(accumulated, k=min(self.kept, accumulated.numel()))
        picked = [(parents[i], tokens[i]) for i in order.tolist()]
        grown = [self.running[parent].extended(token, found[parent]) for parent, token in picked]
        at_cap = self.length + 1 >= self.max_new_tokens
        hits = torch.tensor([at_cap or token in self.stop_ids for _, token in picked])
        self._update_finished(grown, top_scores, hits)
        running_scores = top_scores + hits.to(torch.float32) * _UNREACHABLE
        next_order = torch.topk(running_scores, k=min(self.width, running_scores.numel())).indices
        self.running = [grown[i] for i in next_order.tolist()]
        self._running_scores = running_scores[next_order]
        self.length += 1
        self._check_improvable()
        full = all(beam is not None for beam in self._finished)
        self.done = not self._improvable or (self.early_stopping and full) or bool(hits.all())

    def _update_finished(self, grown: list[Beam], top_scores: torch.Tensor, hits: torch.Tensor) -> None:
        """transformers' `_update_finished_beams`: of the step's best `width` candidates, those that hit a stop token
        or the cap compete with the finished beams, by their length-penalised scores, for the `width` places."""
        just = hits & (torch.arange(hits.numel()) < self.width)
        scores = top_scores / ((self.length + 1) ** self.length_penalty)
        full = all(beam is not None for beam in self._finished) and self.early_stopping
        scores = scores + float(full) * _UNREACHABLE
        scores = scores + float(not self._improvable) * _UNREACHABLE
        scores = scores + (~just).to(torch.float32) * _UNREACHABLE
        merged_scores = torch.cat((self._finished_scores, scores))
        merged: list[FinishedBeam | None] = [*self._finished]
        for index, beam in enumerate(grown):
            stop = beam.token_ids[-1] if beam.token_ids[-1] in self.stop_ids else None
            merged.append(FinishedBeam(beam, float(scores[index]), stop) if just[index] else None)
        keep = torch.topk(merged_scores, k=self.width).indices.tolist()
        self._finished = [merged[i] for i in keep]
        self._finished_scores = merged_scores[keep]

    def _check_improvable(self) -> None:
        """transformers' `_check_early_stop_heuristic` (early_stopping False or True): whether the best running beam,
        scored at the present length, would still beat the worst finished one (while fewer than `width` finished,
        it would)."""
        best = self._running_scores[:1] / (self.length**self.length_penalty)
        finished = torch.tensor([beam is not None for beam in self._finished])
        worst = torch.where(finished, self._finished_scores.min(), _UNREACHABLE)
        self._improvable = self._improvable and bool((best > worst).any())

    def best(self, count: int) -> list[FinishedBeam]:
        """The `count` best finished beams, best first (once `done`). Every place has finished by then; were one not
        (a search whose candidates nearly all ended it), the best running beams take the places left, as ended at
        their length."""
        assert self.done, "the search has ended"
        found = [beam for beam in self._finished[:count] if beam is not None]
        spare = iter(self.running)
        while len(found) < count:
            beam = next(spare, Beam())
            found.append(FinishedBeam(beam, float("-inf"), None))
        return found


def beam_outputs(beams: Sequence[FinishedBeam], top_logprobs: int) -> list[CoreOutput]:
    """Each finished beam as one choice's whole core output: its tokens with their log-probabilities (the chosen
    token's raw one, the step's `top_logprobs` best beside it and its rank among them), stopped on its stop token or
    at the length cap."""
    outputs = []
    for index, found in enumerate(beams):
        tokens = []
        for token, step in zip(found.beam.token_ids, found.beam.steps, strict=True):
            rank = [candidate for candidate, _ in step].index(token) + 1
            top = tuple(step[:top_logprobs])
            tokens.append(SampledToken(token, TokenLogprobs(token, step[rank - 1][1], top, rank)))
        status = RequestStatus.FINISHED_STOPPED if found.stop_token_id is not None else RequestStatus.FINISHED_LENGTH
        outputs.append(CoreOutput(f"beam/{index}", tokens, status, found.stop_token_id))
    return outputs
