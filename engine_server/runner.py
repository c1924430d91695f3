"""The model runner: turns one SchedulerOutput into one forward pass and one batched sampling call.

It owns the model weights, the paged KV cache tensors, the sampler, the per-request seeded generators and the
grammar matchers of constrained requests. The scheduler decides *what* runs; the runner only executes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_server.attention import AttentionMetadata
from engine_server.config import EngineConfig, ModelConfig
from engine_server.core.request import RequestStatus
from engine_server.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine_server.loader import ModelSource
from engine_server.models import allocate_kv_cache, get_model_class, kv_cache_bytes_per_block
from engine_server.sampling import Sampler, SamplerOutput, SamplingRow, TokenLogprobs
from engine_server.structured.matchers import GrammarMatchers, GrammarState

_SEED_MODULUS = 2**63
# How a grammar's state after the sampled token ends the choice (absent: it goes on).
_GRAMMAR_FINISH = {
    GrammarState.COMPLETE: RequestStatus.FINISHED_STOPPED,
    GrammarState.TERMINATED: RequestStatus.FINISHED_STOPPED,
    GrammarState.REJECTED: RequestStatus.FINISHED_ABORTED,
}


@dataclass(frozen=True)
class SampledToken:
    """The token sampled for one request in one step, with its log-probabilities when the request asked.

    `grammar_finish` is set when the request's grammar ends the choice with this token: FINISHED_STOPPED once
    the output is a complete sentence that cannot grow (or the grammar accepted a stop token after one),
    FINISHED_ABORTED if the token broke the grammar (an engine fault, logged). EngineCore applies it.
    """

    token_id: int
    logprobs: TokenLogprobs | None = None
    grammar_finish: RequestStatus | None = None


def resolve_device(device: str) -> torch.device:
    """'auto' means CUDA when available, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but CUDA is not available on this machine")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' is float32 on the CPU (the reference path) and bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def num_kv_blocks(model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype, max_model_len: int) -> int:
    """Blocks that fit in the configured KV memory; at least enough for one sequence of max_model_len tokens."""
    block_size = config.cache.block_size
    per_block = kv_cache_bytes_per_block(model_config, block_size, dtype)
    needed_for_one = -(-max_model_len // block_size) + 1
    blocks = config.cache.memory_bytes // per_block
    if blocks < needed_for_one:
        raise ValueError(
            f"KV cache memory {config.cache.memory_bytes} B holds {blocks} blocks; one {max_model_len}-token "
            f"sequence needs {needed_for_one} ({needed_for_one * per_block} B)"
        )
    return int(blocks)


class ModelRunner:
    """Executes scheduled steps on one device. Not thread-safe: the engine core's step loop owns it."""

    def __init__(self, source: ModelSource, config: EngineConfig, max_model_len: int) -> None:
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_config = source.config
        self.block_size = config.cache.block_size
        torch.manual_seed(config.seed)
        model = get_model_class(source.config.architecture)(source.config, dtype=self.dtype)
        model.load_weights(source.weights())
        self.model = model.to(self.device).eval()
        self.num_blocks = num_kv_blocks(source.config, config, self.dtype, max_model_len)
        self.kv_caches = allocate_kv_cache(source.config, self.num_blocks, self.block_size, self.dtype, self.device)
        self.sampler = Sampler(source.config.vocab_size, self.device)
        self._generators: dict[str, torch.Generator] = {}
        self.grammars = GrammarMatchers(source.config.vocab_size, self.device)

    def release(self, request_id: str) -> None:
        """Forget per-request state (the seeded generator, the grammar matcher) of a finished or aborted request."""
        self._generators.pop(request_id, None)
        self.grammars.release(request_id)

    def _generator(self, scheduled: ScheduledRequest) -> torch.Generator | None:
        request = scheduled.request
        seed = request.sampling_params.seed
        if seed is None:
            return None
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            # The frontend already gave choice i of an n>1 request the seed seed+i.
            generator.manual_seed(seed % _SEED_MODULUS)
            self._generators[request.request_id] = generator
        return generator

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        """Run the scheduled tokens through the model and sample for every request that `needs_sample`."""
        if not output.scheduled:
            return {}
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for item in output.scheduled:
            start, count = item.start_position, item.num_new_tokens
            token_ids.extend(item.request.all_token_ids[start : start + count])
            positions.extend(range(start, start + count))
            query_lens.append(count)
            seq_lens.append(start + count)
        meta = AttentionMetadata.build(
            query_lens, seq_lens, [item.block_ids for item in output.scheduled], self.block_size, self.device
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        position_ids = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, position_ids, self.kv_caches, meta)

        sampling = [i for i, item in enumerate(output.scheduled) if item.needs_sample]
        if not sampling:
            return {}
        ends = meta.query_start_loc[1:].to(torch.long) - 1
        logits = self.model.compute_logits(hidden[ends[sampling]])
        # Filled after the forward is launched: on CUDA the host-side grammar work overlaps the GPU's.
        bitmasks = self.grammars.bitmasks([output.scheduled[i].request for i in sampling])
        rows = [self._row(output.scheduled[i], mask) for i, mask in zip(sampling, bitmasks, strict=True)]
        sampled = self.sampler(logits, rows)
        return self._collect([output.scheduled[i] for i in sampling], sampled)

    def _row(self, item: ScheduledRequest, bitmask: torch.Tensor | None = None) -> SamplingRow:
        request = item.request
        return SamplingRow(
            params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            generator=self._generator(item),
            eos_token_ids=request.eos_token_ids,
            allowed_token_bitmask=bitmask,
        )

    def _collect(self, items: list[ScheduledRequest], sampled: SamplerOutput) -> dict[str, SampledToken]:
        """Per request its token; constrained requests' matchers accept it here (and only here)."""
        tokens, logprobs = sampled.token_id_list(), sampled.logprob_list()
        result: dict[str, SampledToken] = {}
        for item, token, lps in zip(items, tokens, logprobs, strict=True):
            request_id = item.request.request_id
            finish = None
            if item.request.grammar is not None:
                finish = _GRAMMAR_FINISH.get(self.grammars.accept(request_id, token))
            result[request_id] = SampledToken(token, lps, finish)
        return result
