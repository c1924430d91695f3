"""Builders for model-runner tests: a tiny random-weight model, runners on it, and a lockstep driver that runs
two runners on the very same scheduled steps (one scheduler, one KV block layout, separate KV caches)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine_server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_server.core.request import Request
from engine_server.core.scheduler import Scheduler
from engine_server.loader import ModelSource
from engine_server.model_loading import load_model
from engine_server.model_runner import ModelRunner
from engine_server.sampling_params import SamplingParams
from tests.unit.factories import VOCAB

BLOCK_SIZE = 4
MAX_MODEL_LEN = 128

TINY_LLAMA = ModelConfig(
    architecture="llama",
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    name="tiny-llama",
)


def tiny_source(config: ModelConfig = TINY_LLAMA) -> ModelSource:
    """`config` with seeded random weights (the same on every call, so two runners hold identical models)."""
    return ModelSource(config, Path("."), config.name, Path("."), random_weights=True)


def tiny_engine_config(
    device: str = "cpu", *, max_num_seqs: int = 16, enforce_eager: bool = False, max_cuda_graph_batch: int = 512
) -> EngineConfig:
    """Room for 160 blocks of 4 tokens, 128-token sequences and one step that prefills every prompt."""
    block_bytes = 2 * BLOCK_SIZE * TINY_LLAMA.num_key_value_heads * TINY_LLAMA.head_dim * 4 * 2  # fp32, 2 layers
    return EngineConfig(
        device=device,  # type: ignore[arg-type]
        enforce_eager=enforce_eager,
        max_cuda_graph_batch=max_cuda_graph_batch,
        cache=CacheConfig(block_size=BLOCK_SIZE, memory_bytes=160 * block_bytes, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN),
    )


def tiny_runner(config: EngineConfig) -> ModelRunner:
    return ModelRunner(load_model(tiny_source(), config, MAX_MODEL_LEN))


def greedy_request(request_id: str, prompt_len: int, max_tokens: int) -> Request:
    """A greedy request for exactly `max_tokens` tokens after `prompt_len` distinct prompt tokens."""
    base = sum(map(ord, request_id)) * 7
    prompt = [(base + i) % VOCAB for i in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, prompt, params, max_model_len=MAX_MODEL_LEN)


@dataclass
class LockstepStep:
    """One step as both runners saw it: sampled tokens and the hidden rows that went into the LM head."""

    decode_only: bool
    batch: int
    tokens: tuple[dict[str, int], dict[str, int]]  # (reference, candidate)
    hidden: tuple[torch.Tensor, torch.Tensor]  # (reference, candidate), [sampling rows, hidden] on the CPU


@dataclass
class Lockstep:
    """Drives `reference` and `candidate` on one scheduler's steps; the reference's tokens advance it."""

    reference: ModelRunner
    candidate: ModelRunner
    scheduler: Scheduler
    monkeypatch: pytest.MonkeyPatch
    steps: list[LockstepStep] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._seen = (self._record(self.reference), self._record(self.candidate))

    def _record(self, runner: ModelRunner) -> list[torch.Tensor]:
        seen: list[torch.Tensor] = []
        original: Callable[[torch.Tensor], torch.Tensor] = runner.model.compute_logits

        def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
            seen.append(hidden.detach().to("cpu", torch.float32, copy=True))
            return original(hidden)

        self.monkeypatch.setattr(runner.model, "compute_logits", compute_logits)
        return seen

    def run(self, requests: list[Request], late: dict[int, list[Request]] | None = None) -> list[LockstepStep]:
        """Run until every request finished; `late[i]` are added before step i (making that step mixed)."""
        for request in requests:
            self.scheduler.add_request(request)
        late = late or {}
        index = 0
        while self.scheduler.has_unfinished():
            for request in late.get(index, []):
                self.scheduler.add_request(request)
            output = self.scheduler.schedule(now=0.0)
            ref = {rid: s.token_id for rid, s in self.reference.execute(output).items()}
            cand = {rid: s.token_id for rid, s in self.candidate.execute(output).items()}
            hidden = (self._seen[0][-1], self._seen[1][-1]) if ref else (torch.empty(0), torch.empty(0))
            decode_only = all(item.num_new_tokens == 1 for item in output.scheduled)
            self.steps.append(LockstepStep(decode_only, len(output.scheduled), (ref, cand), hidden))
            self.scheduler.update_from_output(output, list(ref.values()))
            index += 1
        return self.steps


def make_lockstep(
    reference: ModelRunner, candidate: ModelRunner, config: EngineConfig, monkeypatch: pytest.MonkeyPatch
) -> Lockstep:
    """A lockstep pair over one scheduler built from `config` (the config both runners were built with)."""
    if reference.num_blocks != candidate.num_blocks:
        raise ValueError("the runners must share one KV block layout")
    scheduler = Scheduler(config.scheduler, config.cache, reference.num_blocks, MAX_MODEL_LEN)
    return Lockstep(reference, candidate, scheduler, monkeypatch)
