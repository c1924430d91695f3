"""Each newer decoder family served whole by the engine on its float path (`--quantization none`): greedy output equal
to transformers' token for token, alone, batched, and with a prefix-cache hit; a mixture of experts also under
tensor parallelism, speculative decoding and preemption; Phi-3 and Gemma 2 under tensor parallelism too. The models
are tiny random ones saved by transformers (tests/families.py). Phi-3 with LongRoPE: prompts on both sides of its
32-token limit, one crossing it while it decodes, each prefilled in one step (as transformers' generate computes a
prompt). Sliding windows: also with prompts prefilled in chunks, and on the quantized path (the C++ decode stack and
by-token attention) batch-invariant. Gemma 3 also under tensor parallelism and on int8 weights; Qwen2-MoE on int8
weights (its experts in the C++ expert kernel) batch-invariant."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine_server import LLM, SamplingParams
from engine_server.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
from engine_server.layers.mla import LatentExpansion, MultiLatentAttention
from engine_server.layers.quantized_experts import ROUTER_SUFFIXES, QuantizedExperts, RowwiseLinear
from engine_server.layers.quantized_linear import QuantizedEmbedding, QuantizedLinear
from engine_server.loader import resolve_model
from engine_server.loader.dummy import dummy_config
from engine_server.models import get_model_class
from engine_server.parallel.layers import ParallelExperts
from tests.families import (
    FAMILIES,
    LAYOUT_FAMILIES,
    VOCAB_SIZE,
    WINDOW,
    GreedyReference,
    assert_dummy_equals_transformers,
    hf_greedy,
    load_reference,
    save_family,
)
from tests.unit.pooling.embedding_models import copy_tokenizer

pytestmark = pytest.mark.slow  # engines and transformers' models of their own

NUM_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
SHARED_PREFIX = 48  # tokens the last prompt shares with the first: three 16-token blocks from the cache


def prompts() -> list[list[int]]:
    """8 prompts of 3 to 120 tokens; the last starts with the first's 48 tokens."""
    rng = random.Random(7)
    batch = [[rng.randrange(10, VOCAB_SIZE) for _ in range(length)] for length in (64, 3, 17, 120, 33, 1, 90)]
    return [*batch, batch[0][:SHARED_PREFIX] + [rng.randrange(10, VOCAB_SIZE) for _ in range(20)]]


def engine(
    folder: Path, quantization: str = "none", chunk: int = 2048, kv_blocks: int = 0, **overrides: Any
) -> LLM:
    """The offline engine on `folder`; `chunk`: the most tokens a step prefills; `kv_blocks`: a KV cache of that
    many 16-token blocks (for 256-token sequences of the 4-layer test models) instead of 64 MiB."""
    memory = kv_blocks * 4 * 2 * 16 * 2 * 16 * 4 if kv_blocks else 64 * 1024**2  # layers, K/V, block, heads, dim, f32
    config = EngineConfig(
        model=str(folder), device="cpu", quantization=quantization, cache=CacheConfig(memory_bytes=memory),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_model_len=256 if kv_blocks else None),
    )  # fmt: skip
    return LLM(config=config, **overrides)


def reference_tokens(folder: Path) -> GreedyReference:
    """transformers' greedy tokens for each of `prompts()` on `folder`'s model, each decoded alone
    (`GreedyReference`: `.of(ours)`)."""
    return GreedyReference(load_reference(folder), prompts(), NUM_TOKENS)


def saved_multimodal(model: Any, folder: Path, reference: Any = None) -> tuple[list[list[int]], GreedyReference]:
    """A multimodal `model` saved to `folder` with the embedded tokenizer: the first four `prompts()` and the greedy
    tokens of `reference` (the model itself by default) for them."""
    model.save_pretrained(folder)
    copy_tokenizer(folder)
    batch = prompts()[:4]
    return batch, GreedyReference(model if reference is None else reference, batch, NUM_TOKENS)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    """(name, saved folder, transformers' greedy tokens for `prompts()`)."""
    folder = save_family(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, folder, reference_tokens(folder)


@pytest.fixture(scope="module")
def gpt_oss_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GreedyReference]:
    """gpt-oss (tests/families.py), with transformers' greedy tokens for `prompts()`."""
    folder = save_family(tmp_path_factory.mktemp("gpt-oss-paths"), "gpt-oss")
    return folder, reference_tokens(folder)


@pytest.fixture(scope="module")
def window_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GreedyReference]:
    """Mistral with a 20-position sliding window on every layer, with transformers' greedy tokens."""
    folder = save_family(tmp_path_factory.mktemp("mistral-window-paths"), "mistral-window")
    return folder, reference_tokens(folder)


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GreedyReference]:
    """Gemma 3 (tests/families.py), with transformers' greedy tokens for `prompts()`."""
    folder = save_family(tmp_path_factory.mktemp("gemma3-paths"), "gemma3")
    return folder, reference_tokens(folder)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GreedyReference]:
    """Qwen2-MoE (experts, a gated shared expert and q/k/v biases all split under tensor parallelism), with
    transformers' greedy tokens for `prompts()`."""
    folder = save_family(tmp_path_factory.mktemp("qwen2-moe-tp"), "qwen2-moe")
    return folder, reference_tokens(folder)


def tokens(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [result.choices[0].token_ids for result in llm.generate(batch, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("name", sorted(LAYOUT_FAMILIES))
def test_layout_families_load_as_saved(name: str, tmp_path: Path) -> None:
    """A family whose parts are all another's (Solar Open, CWM, FlexOlmo, Hy3, K-EXAONE, dots.llm1, Mellum, GLM-4-9B;
    Nemotron-4, OLMo, EXAONE 3.5 with one norm of another form or GPT-2's names: tests.families' `LAYOUT_FAMILIES`),
    saved by transformers under its checkpoints' own names, loads every tensor into the engine's model: none
    unexpected, none missing (what their whole-engine runs caught; their paged models are held to transformers in
    tests/unit/test_models.py). Mellum's file also holds a multi-token-prediction layer (`mtp.`, as its released
    checkpoints do, which transformers does not build), not read."""
    folder = save_family(tmp_path, name)
    if name == "mellum":
        from safetensors.torch import load_file

        state = load_file(folder / "model.safetensors")
        hidden = state["model.embed_tokens.weight"].shape[1]
        mtp = {"mtp.layers.0.eh_proj.weight": torch.zeros(hidden, 2 * hidden),
               "mtp.layers.0.enorm.weight": torch.ones(hidden)}
        save_file({**state, **mtp}, folder / "model.safetensors", metadata={"format": "pt"})
    source = resolve_model(str(folder))
    model = get_model_class(source.config.architecture)(source.config)
    model.load_weights(source.weights())


def test_the_reference_is_transformers_greedy_decoding_whatever_the_candidate(tmp_path: Path) -> None:
    """The oracle itself (`GreedyReference`, checked in one forward pass): given transformers' own step-by-step tokens
    it returns them; given a candidate wrong at one token (mid-sequence, and the first), it still returns
    transformers' tokens, so a wrong engine cannot pass; the first tokens alone are the step-by-step ones too."""
    model = load_reference(save_family(tmp_path, "qwen3-moe"))
    truth = [hf_greedy(model, [prompt], NUM_TOKENS)[0] for prompt in prompts()]
    assert GreedyReference(model, prompts(), NUM_TOKENS).of(truth) == truth
    wrong = [list(tokens) for tokens in truth]
    wrong[2][10] = (wrong[2][10] + 1) % VOCAB_SIZE
    wrong[5][0] = (wrong[5][0] + 7) % VOCAB_SIZE
    assert GreedyReference(model, prompts(), NUM_TOKENS).of(wrong) == truth
    assert GreedyReference(model, prompts(), NUM_TOKENS).first_tokens() == [tokens[0] for tokens in truth]


def test_greedy_equals_transformers_alone_batched_and_from_the_prefix_cache(family: tuple[str, Path, Any]) -> None:
    name, folder, theirs = family
    batch = prompts()
    with engine(folder) as llm:
        alone = tokens(llm, batch[:1])
        assert alone == theirs.of(alone), name  # its blocks stay in the cache
        results = llm.generate(batch, GREEDY, use_tqdm=False)
    ours = [result.choices[0].token_ids for result in results]
    assert ours == theirs.of(ours), name
    assert results[-1].usage.cached_prompt_tokens >= SHARED_PREFIX, name


def test_tensor_parallel_moe_equals_one_rank(moe_folder: tuple[Path, GreedyReference]) -> None:
    folder, theirs = moe_folder
    with engine(folder, tensor_parallel_size=2) as llm:
        ours = tokens(llm, prompts())
        assert ours == theirs.of(ours)


def test_a_mixture_of_experts_keeps_its_tokens_when_preempted(moe_folder: tuple[Path, GreedyReference]) -> None:
    """A KV pool of 24 blocks for eight sequences: sequences preempted and recomputed (the experts' routing of
    every recomputed token again) keep transformers' tokens."""
    folder, theirs = moe_folder
    with engine(folder, kv_blocks=24) as llm:
        ours = tokens(llm, prompts())
        assert ours == theirs.of(ours)
        assert llm.core.scheduler.total_preemptions > 0


@pytest.mark.parametrize(
    "name",
    ["phi3-longrope", "gemma2", "llama4", "glm4", "cohere2", "exaone4", "phimoe", "jais2", "mimo-v2-flash", "gpt-neox",
     "stablelm-12b", "falcon-40b", "gpt2", "dbrx", "opt", "codegen", "axk2"],
)
def test_tensor_parallel_phi3_gemma2_and_llama4_equal_transformers(name: str, tmp_path: Path) -> None:
    """Two ranks: Phi-3's fused q/k/v and gate/up split by part, its partial rotary and LongRoPE on each rank's
    heads; Gemma 2's soft-capped attention on each rank's heads and its final-logit cap after the vocab gather;
    Llama 4's q/k norms and temperature on each rank's heads, its input-scaled experts' rows split; GLM-4's
    reordered q/k rows and biases split by head, its half-head rope and sandwich norms; Cohere 2's parallel block
    (each half all-reduced) and its logit scale after the vocab gather; EXAONE 4's per-head q/k norms under its
    post-norm block, its NoPE global layers; PhiMoE's LM head bias split with its vocab rows, its sparsemixer over
    each rank's whole router; Jais 2's MLP biases (up's split with its rows, down's added once); MiMo-V2-Flash's
    windowed layers' two KV heads a rank each, its full layers' one on both, each rank's padded values and sinks;
    StableLM 2 12B's per-head q/k LayerNorms, each rank its heads' weights; Falcon 40B's q/k/v grouped by KV head
    (GPT-NeoX's, a head a group, likewise), a group a rank, its two-norm parallel block; GPT-2's learned positions
    split by rows like the vocabulary's, its Conv1D weights read transposed; DBRX's clamped `Wqkv` split by part,
    each expert's rows of its layer's one tensor a projection read unread-until-narrowed (`models.dbrx`), `w2`'s
    transposed; OPT's offset positions split by rows, its biased ReLU MLP's down bias added once; CodeGen's q/k/v,
    read apart from its shard-laid projection unread until narrowed, each rank its heads' (and its LM head's bias);
    A.X K2's queries and value gates, split from their joint projection, each rank its heads' rows of both."""
    folder = save_family(tmp_path, name)
    with engine(folder, tensor_parallel_size=2) as llm:
        ours = tokens(llm, prompts())
        assert ours == reference_tokens(folder).of(ours), name


def test_speculative_decoding_on_moe_keeps_greedy_output(moe_folder: tuple[Path, GreedyReference]) -> None:
    folder, theirs = moe_folder
    speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
    with engine(folder, speculative_config=speculative) as llm:
        ours = tokens(llm, prompts())
        assert ours == theirs.of(ours)


def test_a_sliding_window_holds_when_prompts_are_prefilled_in_chunks(
    window_folder: tuple[Path, GreedyReference],
) -> None:
    """Chunks of 24 tokens: a chunk's first tokens reach back into the previous chunk's keys, and only within
    the window."""
    folder, theirs = window_folder
    with engine(folder, chunk=24) as llm:
        ours = tokens(llm, prompts())
        assert ours == theirs.of(ours)


def test_a_sliding_window_holds_under_speculation_and_preemption(window_folder: tuple[Path, GreedyReference]) -> None:
    """n-gram drafts verified as several tokens of one row each (their window reaches back into the cache), then a
    KV pool of 24 blocks for eight sequences: sequences preempted and recomputed keep transformers' tokens."""
    folder, theirs = window_folder
    speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
    with engine(folder, speculative_config=speculative) as llm:
        ours = tokens(llm, prompts())
        assert ours == theirs.of(ours)
    with engine(folder, kv_blocks=24) as llm:
        ours = tokens(llm, prompts())
        assert ours == theirs.of(ours)
        assert llm.core.scheduler.total_preemptions > 0


def test_a_pure_window_model_gives_back_the_blocks_outside_its_window(
    window_folder: tuple[Path, GreedyReference],
) -> None:
    """Three 30-token prompts decoding 150 tokens each on an 18-block pool: each sequence would need 12 blocks by its
    end (36 in all), but holds at most the 4 its window of 20 spans (with a margin) plus a new one, so none is
    preempted; the tokens equal transformers', float path and int8 (the C++ decode stack) alike, against their own
    run alone on a pool that holds everything."""
    folder, _ = window_folder
    batch = [prompt[:30] for prompt in prompts()[:3] if len(prompt) >= 30]
    long = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    model = load_reference(folder)
    theirs = GreedyReference(model, batch, 150)
    with engine(folder, kv_blocks=18) as llm:
        assert llm.core.scheduler.kv_cache.window == WINDOW
        results = llm.generate(batch, long, use_tqdm=False)
        ours = [result.choices[0].token_ids for result in results]
        assert ours == theirs.of(ours)
        assert llm.core.scheduler.total_preemptions == 0
    with engine(folder, quantization="int8") as llm:
        alone = [llm.generate([prompt], long, use_tqdm=False)[0].choices[0].token_ids for prompt in batch]
    with engine(folder, quantization="int8", kv_blocks=18) as llm:
        results = llm.generate(batch, long, use_tqdm=False)
        assert [result.choices[0].token_ids for result in results] == alone
        assert llm.core.scheduler.total_preemptions == 0


def test_a_sliding_window_on_the_quantized_path_is_batch_invariant(window_folder: tuple[Path, GreedyReference]) -> None:
    """int8 weights: every decode step on the C++ decode stack and every prompt token through the by-token
    attention kernel, each with the window. A prompt's tokens are the same alone, batched, prefilled in chunks and
    after a prefix-cache hit, bit for bit; and the window is what the model attends over (the engine's float
    path, already equal to transformers', agrees with the quantized one on most of the first tokens)."""
    folder, theirs = window_folder
    batch = prompts()
    with engine(folder, quantization="int8") as llm:
        model = llm.core.runner.loaded.model
        assert model.model.decode_stack is not None
        assert [layer.self_attn.window for layer in model.model.layers] == [WINDOW] * 4
        alone = [tokens(llm, [prompt])[0] for prompt in batch]
        assert tokens(llm, batch) == alone  # batched, and the last prompt from the cache
    with engine(folder, quantization="int8", chunk=24) as llm:
        assert tokens(llm, batch) == alone
    assert sum(ours[0] == first for ours, first in zip(alone, theirs.first_tokens(), strict=True)) >= 6


def test_gemma3_under_tensor_parallelism_and_chunked_prefill_equals_transformers(
    gemma3_folder: tuple[Path, GreedyReference],
) -> None:
    """Two ranks (q/k norms and the four sandwich norms replicated, GeGLU split), then one rank prefilling in
    24-token chunks (the windowed layers reach back into the previous chunk, the global one over all of it)."""
    folder, theirs = gemma3_folder
    with engine(folder, tensor_parallel_size=2) as llm:
        ours = tokens(llm, prompts())
        assert ours == theirs.of(ours)
    with engine(folder, chunk=24) as llm:
        ours = tokens(llm, prompts())
        assert ours == theirs.of(ours)


def test_gemma3_on_the_quantized_path_is_batch_invariant(gemma3_folder: tuple[Path, GreedyReference]) -> None:
    """int8 weights, its steps in the C++ decode stack (Gemma's blocks: tests/unit/test_decode_stack.py holds them
    to the layers bit for bit): each prompt's tokens are the same alone and batched, and mostly agree with the float
    path's first tokens."""
    folder, theirs = gemma3_folder
    batch = prompts()
    with engine(folder, quantization="int8") as llm:
        assert llm.core.runner.loaded.model.model.decode_stack is not None
        alone = [tokens(llm, [prompt])[0] for prompt in batch]
        assert tokens(llm, batch) == alone
    assert sum(ours[0] == first for ours, first in zip(alone, theirs.first_tokens(), strict=True)) >= 6


def test_gemma4_split_chunked_preempted_and_quantized(tmp_path: Path) -> None:
    """Gemma 4 (tests/families.py: per-layer inputs, full-attention layers of their own shape, the last two layers
    over earlier layers' K/V) keeps transformers' tokens over two ranks (one KV head on the full-attention layers,
    repeated on both), prefilled in 16-token chunks, and preempted from a 24-block pool (a recomputed sequence
    writes the shared K/V again before the layers that read them). Its KV cache is four layers' (the sharing layers
    keep none), and on int8 weights (the per-layer input table too, looked up in 8-bit rows) each prompt's tokens
    are the same alone and batched, and mostly agree with the float path's first tokens."""
    folder = save_family(tmp_path, "gemma4", head_spread=0.5)  # a clear head: no near-ties for int8 to flip
    theirs, batch = reference_tokens(folder), prompts()
    with engine(folder, tensor_parallel_size=2) as llm:
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
    with engine(folder, chunk=16, kv_blocks=24) as llm:
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
        assert llm.core.scheduler.total_preemptions > 0
        caches = llm.core.runner.kv_caches
        assert caches[4] is caches[2] and caches[5] is caches[3] and len({id(c) for c in caches}) == 4
        assert caches[3].shape[-2:] == (1, 32) and caches[0].shape[-2:] == (2, 16)
    with engine(folder, quantization="int8") as llm:
        decoder = llm.core.runner.loaded.model.model
        assert decoder.decode_stack is None and isinstance(decoder.embed_tokens_per_layer, QuantizedEmbedding)
        alone = [tokens(llm, [prompt])[0] for prompt in batch]
        assert tokens(llm, batch) == alone
    assert sum(ours[0] == first for ours, first in zip(alone, theirs.first_tokens(), strict=True)) >= 6


def test_gemma3n_chunked_preempted_quantized_and_split(tmp_path: Path) -> None:
    """Gemma 3n (tests/families.py: AltUp's four streams, LAuReL, the first two MLPs sparse, the last two layers over
    the fourth's and third's K/V) keeps transformers' tokens prefilled in 16-token chunks and preempted from a
    24-block pool (the streams are each step's own: a recomputed sequence rebuilds them from its tokens). On int8
    weights each prompt's tokens are the same alone and batched, and mostly agree with the float path's first
    tokens. Over two ranks (each its block of every MLP's gates: a sparse one's cutoff from their all-reduced sums)
    it keeps them too."""
    folder = save_family(tmp_path, "gemma3n", head_spread=0.5)  # a clear head: no near-ties for int8 to flip
    theirs, batch = reference_tokens(folder), prompts()
    with engine(folder, chunk=16, kv_blocks=24) as llm:
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
        assert llm.core.scheduler.total_preemptions > 0
        caches = llm.core.runner.kv_caches
        assert caches[4] is caches[3] and caches[5] is caches[2] and len({id(c) for c in caches}) == 4
    with engine(folder, quantization="int8") as llm:
        decoder = llm.core.runner.loaded.model.model
        assert decoder.decode_stack is None and isinstance(decoder.layers[0].mlp.gate_up_proj, QuantizedLinear)
        alone = [tokens(llm, [prompt])[0] for prompt in batch]
        assert tokens(llm, batch) == alone
    assert sum(ours[0] == first for ours, first in zip(alone, theirs.first_tokens(), strict=True)) >= 6
    with engine(folder, tensor_parallel_size=2) as llm:
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)


def test_gemma4_experts_split_and_chunked_and_on_int8(tmp_path: Path) -> None:
    """Gemma 4's mixture of experts (tests/families.py: top-2 of 4 GELU experts beside each dense MLP) keeps
    transformers' tokens over two ranks (each expert's rows split) and prefilled in 16-token chunks; on int8 the
    experts run in the C++ expert kernel with GELU, a prompt's tokens are the same alone and batched, and the first
    tokens mostly agree with the float path's."""
    folder = save_family(tmp_path, "gemma4-moe", head_spread=0.5)
    theirs, batch = reference_tokens(folder), prompts()
    with engine(folder, tensor_parallel_size=2) as llm:
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
    with engine(folder, chunk=16) as llm:
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
    with engine(folder, quantization="int8") as llm:
        model = llm.core.runner.loaded.model
        experts = model.model.layers[0].experts
        assert isinstance(experts, QuantizedExperts) and experts.gelu
        assert isinstance(model.model.layers[0].mlp.gate_up_proj, QuantizedLinear)
        ours = tokens(llm, batch)
        assert [tokens(llm, [prompt])[0] for prompt in batch] == ours
    assert sum(a[0] == b for a, b in zip(ours, theirs.first_tokens(), strict=True)) >= 6


def test_a_dummy_gemma3n_equals_transformers_holding_its_weights() -> None:
    """`dummy:gemma3n-tiny`: seeded random weights in Gemma 3n's checkpoint layout (AltUp's and LAuReL's per layer,
    the streams' projections, no K/V projections on the sharing layers), served by the engine, and the same weights
    in transformers' Gemma 3n (`benchmarks.common.hf_model`). The presets of the released E2B's and E4B's shapes
    read as transformers builds them."""
    assert_dummy_equals_transformers("gemma3n-tiny", [prompt[:40] for prompt in prompts()[:3]], atol=3e-4)
    for preset, layers, shared in (("gemma-3n-e2b", 30, 10), ("gemma-3n-e4b", 35, 15)):
        config = dummy_config(preset, f"dummy:{preset}")
        assert config.altup is not None and config.gemma4 is not None and config.num_hidden_layers == layers
        assert sum(config.kv_source(i) != i for i in range(layers)) == shared
        assert config.altup.sparsity == (0.95,) * 10 + (0.0,) * (layers - 10)


def test_a_dummy_gemma4_equals_transformers_holding_its_weights() -> None:
    """`dummy:gemma4-tiny`: seeded random weights in Gemma 4's checkpoint layout (per-layer head shapes, no K/V
    projections on the sharing layers, no v_proj where values are the keys', per-layer inputs), served by the engine,
    and the same weights in transformers' Gemma 4 (`benchmarks.common.hf_model`, the benchmarks' peer). Ten layers
    of float32 sums in other orders: a few of 2M logits differ by up to ~1.5e-4 (a misplaced weight moves them all by
    tenths)."""
    assert_dummy_equals_transformers("gemma4-tiny", [prompt[:40] for prompt in prompts()[:3]], atol=3e-4)


def test_a_multimodal_gemma4_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """The released Gemma 4 checkpoints are `Gemma4ForConditionalGeneration`: a `text_config`, the text model's
    weights under `model.language_model.`, a vision tower (and on the small models an audio tower) beside them,
    which are not read. Its text output equals transformers' own multimodal model's on text prompts."""
    import transformers

    from tests.families import _SHAPE, FAMILIES

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
    config = transformers.Gemma4Config(text_config={**_SHAPE, **FAMILIES["gemma4"][1]}, vision_config=vision)
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1 and "language_model" in name:
                parameter.normal_(0.0, 0.08)
    batch, theirs = saved_multimodal(model, tmp_path)
    with engine(tmp_path) as llm:
        assert llm.core.model_config.architecture == "gemma4"
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)


def test_a_multimodal_apertus15_checkpoint_serves_its_text_model_through_its_pruned_head(tmp_path: Path) -> None:
    """Apertus 1.5's checkpoints are `Apertus1p5ForConditionalGeneration`: a `text_config` over a vocabulary with
    image and audio codes, the text model under `model.language_model.`, an LM head of the first `output_vocab_size`
    rows alone, and image and audio tokenizers beside them, which are not read. Its text output equals transformers'
    own multimodal model's on text prompts; the tokens past the head's rows have -inf logits."""
    import transformers

    from tests.families import _SHAPE, draw_language_model

    text = {**_SHAPE, "head_dim": 16, "output_vocab_size": 48000, "tie_word_embeddings": False}
    vision = {"codebook_size": 64, "embed_dim": 32, "latent_channels": 32, "base_channels": 32,
              "channel_multiplier": [1, 1], "num_res_blocks": 1, "attn_resolutions": [], "resolution": 16}
    audio = {"model_type": "wavtokenizer_encoder", "codebook_size": 64, "codebook_dim": 16, "hidden_size": 16,
             "num_filters": 4, "upsampling_ratios": [2, 2], "num_lstm_layers": 1}  # fmt: skip
    config = transformers.Apertus1p5Config(
        text_config=text, vision_config=vision, audio_config=audio, image_token_offset=49000, audio_token_offset=49064
    )
    torch.manual_seed(0)
    model = transformers.Apertus1p5ForConditionalGeneration(config).eval()
    draw_language_model(model, head=True)  # (its head is beside the language model)
    batch, theirs = saved_multimodal(model, tmp_path)
    with engine(tmp_path) as llm:
        assert llm.core.model_config.output_vocab_size == 48000
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
        runner = llm.core.runner.loaded.model
        logits = runner.compute_logits(torch.randn(2, _SHAPE["hidden_size"]))
        assert logits.shape == (2, _SHAPE["vocab_size"]) and torch.isinf(logits[:, 48000:]).all()
        assert torch.isfinite(logits[:, :48000]).all()


def test_a_multimodal_cohere_compass_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """Cohere Compass (North) checkpoints are `CohereCompassForConditionalGeneration`: a `text_config` (Command A's
    block with rope over halves on its windowed layers, none on its full one), the text model under
    `model.language_model.` and a vision tower beside it, which is not read. Its text output equals transformers' own
    multimodal model's on text prompts."""
    import transformers

    from tests.families import _SHAPE, WINDOW, draw_language_model

    text = {**_SHAPE, "head_dim": 16, "sliding_window": WINDOW, "logit_scale": 0.5,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "eos_token_id": 2,
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 50000.0},
                                "full_attention": None}}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "num_position_embeddings": 64, "deepstack_visual_indexes": []}  # fmt: skip
    config = transformers.CohereCompassConfig(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = transformers.CohereCompassForConditionalGeneration(config).eval()
    draw_language_model(model, head=True)  # (its head is beside the language model)
    batch, theirs = saved_multimodal(model, tmp_path)
    with engine(tmp_path) as llm:
        config_read = llm.core.model_config
        assert config_read.rope_halves and config_read.nope_layers == (3,) and config_read.logit_scale == 0.5
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)


def test_a_multimodal_llama4_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """The released Llama 4 checkpoints are `Llama4ForConditionalGeneration`: a `text_config`, the text model's
    weights under `language_model.`, a vision model and its projector beside them, which are not read. Its text
    output equals that of transformers' text model within the multimodal one (whose own forward fails without
    images in transformers 5.24: it reads `image_outputs` from the text model's output)."""
    import transformers

    from tests.families import _SHAPE, FAMILIES, draw_language_model

    vision = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
              "image_size": 28, "patch_size": 14, "vision_output_dim": 32, "projector_input_dim": 32,
              "projector_output_dim": 64}  # fmt: skip
    config = transformers.Llama4Config(text_config={**_SHAPE, **FAMILIES["llama4"][1]}, vision_config=vision)
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    draw_language_model(model)
    batch, theirs = saved_multimodal(model, tmp_path, reference=model.language_model)
    with engine(tmp_path) as llm:
        assert llm.core.model_config.architecture == "llama4"
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)


# Mistral Small 4's text model (`mistral4`): DeepSeek-V3's latent attention with Llama 4's query temperature (over a
# 32-token original context), softmax routing of top-2 of 8 experts within the best of 2 groups, a shared expert.
MISTRAL4_TEXT = {
    "model_type": "mistral4", "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8, "v_head_dim": 10, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
    "topk_group": 1, "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.5, "pad_token_id": 0,
    "rope_parameters": {"type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                        "llama_4_scaling_beta": 0.5},
}  # fmt: skip


@pytest.mark.parametrize("text_model", ["ministral3", "mistral4"])
def test_a_multimodal_mistral3_checkpoint_serves_its_text_model(text_model: str, tmp_path: Path) -> None:
    """Mistral Small 3.1 / 3.2, Ministral 3 and Mistral Small 4 are released as `Mistral3ForConditionalGeneration`: a
    `text_config` (Ministral 3's, or Mistral 4's latent attention and experts), the text model's weights under
    `language_model.`, a Pixtral vision tower and its projector beside them, which are not read. Its text output
    equals transformers' own multimodal model's on text prompts (Mistral 4's checked whole only so: transformers
    builds no causal LM of it alone)."""
    import transformers

    from tests.families import _SHAPE, FAMILIES, draw_language_model

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "head_dim": 16, "image_size": 28, "patch_size": 14}  # fmt: skip
    quirks = {**FAMILIES["ministral3"][1], "model_type": "ministral3"} if text_model == "ministral3" else MISTRAL4_TEXT
    config = transformers.Mistral3Config(text_config={**_SHAPE, **quirks}, vision_config=vision,
                                         tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    draw_language_model(model)
    batch, theirs = saved_multimodal(model, tmp_path)
    with engine(tmp_path) as llm:
        config = llm.core.model_config
        assert config.architecture == ("llama" if text_model == "ministral3" else "deepseek_v3")
        assert config.query_scale_beta == 0.5
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)


def test_an_exaone4_5_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """EXAONE 4.5 is released as `Exaone4_5_ForConditionalGeneration`: a `text_config` of EXAONE 4.0 (its windowed
    layers and NoPE global ones here; `exaone4_5_text`, its first release's name for it, read as `exaone4`), the text
    model's weights under `model.language_model.`, a vision tower (`model.visual.`) beside them, which is not read.
    Its text output equals transformers' own multimodal model's on text prompts."""
    import transformers

    from tests.families import _SHAPE, FAMILIES, draw_language_model

    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "fullatt_block_indexes": [0], "window_size": 28}  # fmt: skip
    text = {**_SHAPE, **FAMILIES["exaone4"][1], "model_type": "exaone4"}
    config = transformers.Exaone4_5_Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = transformers.Exaone4_5_ForConditionalGeneration(config).eval()
    draw_language_model(model)
    model.save_pretrained(tmp_path)
    copy_tokenizer(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["text_config"]["model_type"] = "exaone4_5_text"  # (its first release's name)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    batch = prompts()[:4]
    theirs = GreedyReference(model, batch, NUM_TOKENS)
    with engine(tmp_path) as llm:
        config = llm.core.model_config
        assert (config.architecture, bool(config.layer_windows), bool(config.nope_layers)) == ("olmo2", True, True)
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)


def test_a_kimi_k25_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """Kimi K2.5 is released as `Kimi_K25ForConditionalGeneration`: a `text_config` of Kimi K2's DeepSeek-V3 layout
    (its own LM head: the text model's tie is read, not the wrapper's), the text model's weights under `language_model.`
    (`language_model.model.layers.N`, `language_model.lm_head`), a vision tower and its projector (`mm_projector`)
    beside them, which are not read; transformers 5 holds them as `model.language_model.`, `model.vision_tower.` and
    `model.mm_projector.`. Written in either layout (transformers' own save turns the language model's `layers` into
    `blocks`, reversing a rename meant for the vision tower's, so the released layout is written here from its state
    dict), its text output equals transformers' own multimodal model's on text prompts."""
    import transformers

    from tests.families import _SHAPE, FAMILIES, draw_language_model

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "patch_size": 14, "pos_emb_height": 4, "pos_emb_width": 4}  # fmt: skip
    text = {**_SHAPE, **FAMILIES["deepseek-v3"][1], "model_type": "deepseek_v3", "tie_word_embeddings": False}
    config = transformers.Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32,
                                         tie_word_embeddings=False)  # (transformers would tie the head in memory)
    torch.manual_seed(0)
    model = transformers.Kimi_K25ForConditionalGeneration(config).eval()
    draw_language_model(model)
    batch = prompts()[:4]
    theirs = GreedyReference(model, batch, NUM_TOKENS)
    released = (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                ("model.vision_tower.", "vision_tower.encoder."), ("model.mm_projector.", "mm_projector."))  # fmt: skip
    for layout, renames in (("released", released), ("transformers", ())):
        folder = tmp_path / layout
        config.save_pretrained(folder)
        copy_tokenizer(folder)
        state = {}
        for name, tensor in model.state_dict().items():
            for theirs_prefix, ours in renames:
                if name.startswith(theirs_prefix):
                    name = ours + name.removeprefix(theirs_prefix)
            state[name] = tensor.clone()
        save_file(state, folder / "model.safetensors")
        with engine(folder) as llm:
            assert llm.core.model_config.architecture == "deepseek_v3"
            assert not llm.core.model_config.tie_word_embeddings
            ours = tokens(llm, batch)
            assert ours == theirs.of(ours), layout


def test_a_hy4_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """Hy4 is released as `HYV4VLForConditionalGeneration`: HY-V4's text model (its `text_config`, with M-RoPE, which
    turns a text token as plain rope does) beside a vision tower (`vit.`, transformers' `model.vision_tower.`), which
    is not read. Saved by transformers (its released names: the text model under `model.`, HY-V4's own renames) and
    as transformers holds it (`model.language_model.`), its text output equals transformers' own multimodal model's
    on text prompts."""
    import transformers

    from tests.families import _SHAPE, FAMILIES, draw_language_model

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "out_hidden_size": 64, "patch_size": 14}  # fmt: skip
    text = {**_SHAPE, **FAMILIES["hy-v4"][1], "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [2, 1, 1]}}  # fmt: skip
    config = transformers.HYV4VLConfig(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = transformers.HYV4VLForConditionalGeneration(config).eval()
    draw_language_model(model, head=True)
    batch = prompts()[:4]
    theirs = GreedyReference(model, batch, NUM_TOKENS)
    released = tmp_path / "released"
    model.save_pretrained(released)
    copy_tokenizer(released)
    saved = set(load_file(next(released.glob("*.safetensors"))))
    assert any(name.startswith("vit.") for name in saved) and "model.layers.1.hc_pre.hc_attn_layer.hc_fn" in saved
    memory = tmp_path / "transformers"
    config.save_pretrained(memory)
    copy_tokenizer(memory)
    save_file({name: tensor.clone() for name, tensor in model.state_dict().items()}, memory / "model.safetensors")
    for folder in (released, memory):
        with engine(folder) as llm:
            assert llm.core.model_config.hyper_connections is not None
            ours = tokens(llm, batch)
            assert ours == theirs.of(ours), folder.name


def test_a_mixture_of_experts_on_the_quantized_path_is_batch_invariant(
    moe_folder: tuple[Path, GreedyReference],
) -> None:
    """int8 weights: every bank of experts quantized and run in one C++ call per layer, the shared expert's
    projections quantized, the router and the shared expert's gate float but multiplied row by row. Each prompt's
    tokens are the same alone, batched (the last prompt from the prefix cache) and prefilled in chunks, bit for bit,
    and mostly agree with the float path's first tokens."""
    folder, theirs = moe_folder
    batch = prompts()
    with engine(folder, quantization="int8") as llm:
        model = llm.core.runner.loaded.model
        banks = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
        routers = [m for name, m in model.named_modules() if name.endswith(ROUTER_SUFFIXES)]
        assert len(banks) == 4 and len(routers) == 8 and all(isinstance(r, RowwiseLinear) for r in routers)
        alone = [tokens(llm, [prompt])[0] for prompt in batch]
        assert tokens(llm, batch) == alone
    with engine(folder, quantization="int8", chunk=24) as llm:
        assert tokens(llm, batch) == alone
    assert sum(ours[0] == first for ours, first in zip(alone, theirs.first_tokens(), strict=True)) >= 6


def test_opt_on_int8_is_batch_invariant(tmp_path: Path) -> None:
    """OPT on int8 weights: its projections quantized (its LayerNorms keep it off the C++ decode stack), its biases
    float; each prompt's tokens the same alone, batched and prefilled in chunks, and mostly the float path's first
    ones."""
    folder = save_family(tmp_path, "opt", head_spread=0.5)
    batch = prompts()
    with engine(folder, quantization="int8") as llm:
        model = llm.core.runner.loaded.model
        assert isinstance(model.model.layers[0].mlp.up_proj, QuantizedLinear) and model.model.decode_stack is None
        alone = [tokens(llm, [prompt])[0] for prompt in batch]
        assert tokens(llm, batch) == alone
    with engine(folder, quantization="int8", chunk=24) as llm:
        assert tokens(llm, batch) == alone
    first = reference_tokens(folder).first_tokens()
    assert sum(ours[0] == token for ours, token in zip(alone, first, strict=True)) >= 6


def test_dbrx_on_int8_is_batch_invariant(tmp_path: Path) -> None:
    """DBRX on int8 weights: each layer's experts, split from their one tensor a projection, quantized into a bank
    (its LayerNorms keep it off the C++ decode stack: the layers run in Python), the router row by row. Each prompt's
    tokens are the same alone, batched and prefilled in chunks, and mostly agree with the float path's first ones."""
    folder = save_family(tmp_path, "dbrx")
    batch = prompts()
    with engine(folder, quantization="int8") as llm:
        model = llm.core.runner.loaded.model
        banks = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
        routers = [m for name, m in model.named_modules() if name.endswith(ROUTER_SUFFIXES)]
        assert len(banks) == 4 and len(routers) == 4 and all(isinstance(r, RowwiseLinear) for r in routers)
        assert model.model.decode_stack is None
        alone = [tokens(llm, [prompt])[0] for prompt in batch]
        assert tokens(llm, batch) == alone
    with engine(folder, quantization="int8", chunk=24) as llm:
        assert tokens(llm, batch) == alone
    first = reference_tokens(folder).first_tokens()
    assert sum(ours[0] == token for ours, token in zip(alone, first, strict=True)) >= 6


def test_a_json_schema_constrains_a_mixture_of_experts(moe_folder: tuple[Path, GreedyReference]) -> None:
    """The grammar's mask applies to the MoE's logits as to any model's: every output parses and validates."""
    import json

    import jsonschema

    from engine_server.structured import Constraint

    folder, _ = moe_folder
    schema = {"type": "object", "properties": {"kind": {"enum": ["alpha", "beta"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["kind", "n"], "additionalProperties": False}  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=64, constraint=Constraint.json_schema(json.dumps(schema)))
    with engine(folder) as llm:
        results = llm.generate(prompts()[:4], params, use_tqdm=False)
    for result in results:
        jsonschema.validate(json.loads(result.choices[0].text), schema)


def test_gpt_oss_under_tensor_parallelism_and_chunked_prefill_equals_transformers(
    gpt_oss_folder: tuple[Path, GreedyReference],
) -> None:
    """Two ranks (each with its heads' sinks, its slices of every expert and its gate/up biases; the down biases
    added once), then one rank prefilling in 24-token chunks (the windowed layers reach back into the previous
    chunk)."""
    folder, theirs = gpt_oss_folder
    with engine(folder, tensor_parallel_size=2) as llm:
        ours = tokens(llm, prompts())
        assert ours == theirs.of(ours)
    with engine(folder, chunk=24) as llm:
        ours = tokens(llm, prompts())
        assert ours == theirs.of(ours)


def test_gpt_oss_on_int8_and_fp8_weights(gpt_oss_folder: tuple[Path, GreedyReference]) -> None:
    """int8: the attention's projections quantized, every bank of experts in the C++ expert kernel (with its biases
    and the clamped SwiGLU), the biased router float but multiplied row by row, no decode stack (sinks); each
    prompt's tokens are the same alone, batched and prefilled in chunks, bit for bit. fp8: every expert in e4m3
    with its biases kept. Both mostly agree with the float path's first tokens."""
    from engine_server.layers.fp8_experts import Fp8Experts
    from engine_server.layers.quantized_experts import QuantizedExperts, RowwiseLinear

    folder, theirs = gpt_oss_folder
    batch = prompts()
    for quantization, bank_type in (("int8", QuantizedExperts), ("fp8", Fp8Experts)):
        with engine(folder, quantization=quantization) as llm:
            model = llm.core.runner.loaded.model
            banks = [m for m in model.modules() if isinstance(m, ParallelExperts | Fp8Experts | QuantizedExperts)]
            assert len(banks) == 4 and all(type(bank) is bank_type for bank in banks), quantization
            assert model.model.decode_stack is None
            if quantization == "int8":
                assert all(bank.b13 is not None and bank.swiglu == (1.702, 1.0, 1.0) for bank in banks)
                table = model.model.embed_tokens  # untied: its own 8-bit rows, quantized from the float table
                assert isinstance(table, QuantizedEmbedding) and table.format == "q8" and table.packed is None
                routers = [m for name, m in model.named_modules() if name.endswith(".mlp.gate")]
                assert len(routers) == 4 and all(isinstance(r, RowwiseLinear) and r.bias is not None for r in routers)
                ours = [tokens(llm, [prompt])[0] for prompt in batch]
                assert tokens(llm, batch) == ours
            else:
                ours = tokens(llm, batch)
        if quantization == "int8":
            with engine(folder, quantization="int8", chunk=24) as llm:
                assert tokens(llm, batch) == ours
        agree = sum(a[0] == b for a, b in zip(ours, theirs.first_tokens(), strict=True))
        assert agree >= 6, (quantization, agree)


def mxfp4_gpt_oss(tmp_path: Path) -> tuple[Path, Path]:
    """gpt-oss in its released files' layout: every expert projection as MXFP4 blocks and scales
    (`quantization_config` mxfp4), and a float folder holding the same experts dequantized (transformers' oracle)."""
    from safetensors.torch import load_file, save_file

    from engine_server.loader.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    folder = save_family(tmp_path / "mxfp4", "gpt-oss")
    tensors = load_file(folder / "model.safetensors")
    packed: dict[str, torch.Tensor] = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = tensors.pop(name).transpose(1, 2)  # [E, out, in], as the MXFP4 files store them
        blocks, scales = quantize_mxfp4(rows)
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        tensors[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
    save_file(tensors, tmp_path / "dequantized.safetensors")
    config = json.loads((folder / "config.json").read_text())
    others = {n: t for n, t in tensors.items() if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**others, **packed}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    reference_folder = save_family(tmp_path / "dequantized", "gpt-oss")
    (reference_folder / "model.safetensors").unlink()
    (tmp_path / "dequantized.safetensors").rename(reference_folder / "model.safetensors")
    return folder, reference_folder


def test_gpt_oss_mxfp4_experts_load_as_their_values(tmp_path: Path) -> None:
    """The released files' layout on the float path: the engine's greedy tokens equal transformers' on a folder
    holding the same experts dequantized."""
    folder, reference_folder = mxfp4_gpt_oss(tmp_path)
    with engine(folder) as llm:
        ours = tokens(llm, prompts())
        assert ours == reference_tokens(reference_folder).of(ours)


def test_gpt_oss_mxfp4_experts_are_served_as_stored_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`auto` on the CPU serves an MXFP4 checkpoint as `int8` with its experts as stored: every bank in the expert
    kernel in MXFP4 (with its biases and the clamped SwiGLU), none dequantized on the way (the float experts are
    never loaded); each prompt's tokens are the same alone and batched, and mostly agree with transformers' first
    tokens on the dequantized experts. Under TP=2 each rank's 48 rows are not whole groups of 32: the banks load
    dequantized and stay float there, as any int8 bank does."""
    import engine_server.models.gpt_oss as gpt_oss

    folder, reference_folder = mxfp4_gpt_oss(tmp_path)
    theirs = reference_tokens(reference_folder)
    dequantize = gpt_oss.dequantize_mxfp4

    def refused(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("an MXFP4 bank served as stored was dequantized")

    monkeypatch.setattr(gpt_oss, "dequantize_mxfp4", refused)
    batch = prompts()
    with engine(folder, quantization="auto") as llm:
        loaded = llm.core.runner.loaded
        assert loaded.quantization == "int8"
        banks = [m for m in loaded.model.modules() if isinstance(m, ParallelExperts | QuantizedExperts)]
        assert len(banks) == 4 and all(isinstance(b, QuantizedExperts) and b.format == "mxfp4" for b in banks)
        assert all(bank.b13 is not None and bank.swiglu == (1.702, 1.0, 1.0) for bank in banks)
        ours = [tokens(llm, [prompt])[0] for prompt in batch]
        assert tokens(llm, batch) == ours
    agree = sum(a[0] == b for a, b in zip(ours, theirs.first_tokens(), strict=True))
    assert agree >= 6, agree
    monkeypatch.setattr(gpt_oss, "dequantize_mxfp4", dequantize)
    with engine(folder, quantization="int8", tensor_parallel_size=2) as llm:
        assert not [m for m in llm.core.runner.loaded.model.modules() if isinstance(m, QuantizedExperts)]
        assert len(tokens(llm, batch)) == len(batch)


def test_hf_overrides_give_a_model_yarn_as_its_config_would(tmp_path: Path) -> None:
    """vLLM's --hf-overrides: a plain Llama served with Qwen's long-context YaRN laid over its config.json gives
    transformers' tokens for the same weights saved with that config (and the longer context); a malformed value
    is refused before anything loads."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    plain = save_family(tmp_path / "plain", "llama")
    theirs = reference_tokens(save_family(tmp_path / "yarn", "llama", rope_parameters=yarn))
    config = EngineConfig(
        model=str(plain), device="cpu", quantization="none", cache=CacheConfig(memory_bytes=64 * 1024**2),
        hf_overrides=json.dumps({"rope_parameters": yarn, "max_position_embeddings": 128}),
    )  # fmt: skip
    with LLM(config=config) as llm:
        assert llm.core.runner.loaded.model.config.max_position_embeddings == 256  # 64 x 4, as vLLM derives it
        ours = tokens(llm, prompts())
        assert ours == theirs.of(ours)
        first = tokens(llm, prompts()[:1])
        assert first != reference_tokens(plain).of(first)
    for bad, message in (("[1]", "must be a JSON object"), ("{", "not JSON")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(model=str(plain), hf_overrides=bad)


@pytest.mark.parametrize(
    "name",
    ["smollm3", "granite", "olmo2", "cohere2", "llama4", "ministral3", "hunyuan-moe", "apertus", "phimoe", "jais2",
     "cohere2-moe", "mimo-v2-flash", "gpt-neox", "gpt-bigcode", "nanochat", "hyperclovax", "persimmon", "xglm",
     "biogpt"],
)
def test_newer_families_on_the_quantized_path_are_batch_invariant(name: str, tmp_path: Path) -> None:
    """int8 weights, SmolLM3's NoPE layers, Granite's multipliers, HyperCLOVA X's (beside its sandwich norms),
    Ministral 3's scaled queries, Cohere 2's parallel blocks and OLMo 2's post-norm ones in the C++ decode stack, the
    others on the layers (the stack runs neither Llama 4's NoPE layers, Cohere 2 MoE's experts beside a parallel
    block, Hunyuan's q/k norms
    after rope (NanoChat's too), Apertus's xIELU MLP, PhiMoE's LayerNorms and router nor the GPT-NeoX lineage's GELU
    MLPs and LayerNorms; Llama 4's, Hunyuan's and PhiMoE's experts quantized too): each prompt's tokens are the same
    alone and batched, and mostly agree with the float path's."""
    folder = save_family(tmp_path, name)
    theirs, batch = reference_tokens(folder), prompts()
    with engine(folder, quantization="int8") as llm:
        model = llm.core.runner.loaded.model
        stacked = ("smollm3", "granite", "hyperclovax", "ministral3", "cohere2", "olmo2")
        assert (model.model.decode_stack is not None) == (name in stacked)
        banks = sum(isinstance(module, QuantizedExperts) for module in model.modules())
        # Llama 4's sparse layers, one in two; Cohere2-MoE's after its dense first
        assert banks == {"llama4": 2, "hunyuan-moe": 4, "phimoe": 4, "cohere2-moe": 3, "mimo-v2-flash": 3}.get(name, 0)
        alone = [tokens(llm, [prompt])[0] for prompt in batch]
        assert tokens(llm, batch) == alone
    assert sum(ours[0] == first for ours, first in zip(alone, theirs.first_tokens(), strict=True)) >= 6


def test_deepseek_v3_on_int8_and_fp8_and_what_it_refuses(tmp_path: Path) -> None:
    """int8: the latent attention's projections and the experts quantized, the sigmoid router float (no decode
    stack: the attention is not the stack's); fp8: the projections and experts in e4m3; `kv_b_proj`, absorbed into
    the queries and outputs, float under both. The cache holds one row per token and layer, the 32-dim latent and
    its 8 rope dims under one KV head; an FP8 cache holds those rows in e4m3 beside their scales. All mostly agree
    with the float path's first tokens. LoRA adapters are refused."""
    folder = save_family(tmp_path, "deepseek-v3", head_spread=1.0)  # a clear next token (families.save_family)
    theirs = reference_tokens(folder)
    # At least this many of the 8 first tokens agree: e4m3 moves this tiny model's latents more than 8-bit groups do
    # (over 8 prompts x 16 tokens, top-1 0.76 against int8's 0.88; Qwen3-MoE's are 0.86 and 0.98).
    for quantization, cache, least in (("int8", "auto", 7), ("fp8", "auto", 5), ("none", "fp8", 7)):
        config = EngineConfig(
            model=str(folder), device="cpu", quantization=quantization,
            cache=CacheConfig(memory_bytes=64 * 1024**2, dtype=cache),
        )  # fmt: skip
        with LLM(config=config) as llm:
            model = llm.core.runner.loaded.model.model
            assert model.decode_stack is None
            expansion = model.layers[0].self_attn.kv_b_proj
            assert isinstance(expansion, LatentExpansion) and expansion.weight.dtype == torch.float32
            rows = (32 + 8 + 4, torch.uint8) if cache == "fp8" else (32 + 8, torch.float32)
            assert all((c.shape[2:], c.dtype) == ((16, 1, rows[0]), rows[1]) for c in llm.core.runner.kv_caches)
            ours = tokens(llm, prompts())
        agree = sum(a[0] == b for a, b in zip(ours, theirs.first_tokens(), strict=True))
        assert agree >= least, (quantization, cache, agree)
    with_lora = EngineConfig(model=str(folder), device="cpu", quantization="none", lora=LoraConfig())
    with pytest.raises(ValueError, match="LoRA adapters are not applied to multi-head latent attention"):
        LLM(config=with_lora)


def test_an_axk1_checkpoint_in_its_released_layout_equals_transformers(tmp_path: Path) -> None:
    """A.X K1's released checkpoints (as transformers reads them): no routing bias (zeros), and a
    `post_mlp_layernorm` on a dense layer too, which nothing applies. Its MoE output norms (`post_mlp_layernorm` on
    the layer, read as the MoE block's) are what the family's whole-engine test runs."""
    from safetensors.torch import load_file

    folder = save_family(tmp_path, "axk1", head_spread=1.0)  # a clear next token (families.save_family)
    tensors = {name: tensor for name, tensor in load_file(folder / "model.safetensors").items()
               if not name.endswith("e_score_correction_bias")}  # fmt: skip
    tensors["model.layers.0.post_mlp_layernorm.weight"] = torch.randn(tensors["model.norm.weight"].shape)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with engine(folder) as llm:
        ours = tokens(llm, prompts())
        assert ours == reference_tokens(folder).of(ours)


@pytest.mark.parametrize(
    ("name", "changed"),
    [("deepseek-v3", {}), ("deepseek-v2", {"q_lora_rank": None}), ("glm-moe-dsa", {}), ("axk1", {})],
)
def test_latent_attention_split_over_two_ranks_equals_transformers(
    name: str, changed: dict[str, Any], tmp_path: Path
) -> None:
    """Two ranks, two of the four heads each: each rank its heads' rows of `q_b_proj` (DeepSeek-V3, GLM-5) or of
    the one `q_proj` (DeepSeek-V2-Lite's form), of `kv_b_proj` and its columns of `o_proj`, the latent, its cache
    and GLM-5's indexer whole on both (the indexer's choice among 140 positions the same on each, its third layer
    reusing the second's; A.X K1's MoE output norm after the ranks' sums): transformers' tokens. DeepSeek-V3 on int8
    over the two ranks: each prompt's tokens the same alone and batched, mostly transformers' first ones."""
    folder = save_family(tmp_path, name, head_spread=1.0, **changed)  # a clear next token (families.save_family)
    theirs, batch = reference_tokens(folder), prompts()
    with engine(folder, tensor_parallel_size=2) as llm:
        attention = llm.core.runner.loaded.model.model.layers[1].self_attn
        assert isinstance(attention, MultiLatentAttention) and attention.num_heads == 2
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
    if name != "deepseek-v3":
        return
    with engine(folder, quantization="int8", tensor_parallel_size=2) as llm:
        alone = [tokens(llm, [prompt])[0] for prompt in batch]
        assert tokens(llm, batch) == alone
    assert sum(ours[0] == first for ours, first in zip(alone, theirs.first_tokens(), strict=True)) >= 7


def test_sparse_attention_chunked_preempted_speculated_and_quantized(tmp_path: Path) -> None:
    """DeepSeek-V3.2's indexer (tests/families.py: 16 positions per query, prompts to 144 positions) keeps
    transformers' tokens with prompts prefilled in 24-token chunks on a pool of 24 blocks (each chunk's queries
    choosing among the index keys earlier chunks cached; sequences preempted and recomputed) and under n-gram drafts
    verified several tokens to a row. Each cache row is the longer of the latent with its rope key (32 + 8) and the
    latent with its index key (32 + 16), in e4m3 beside its scale in an FP8 cache, whose first tokens mostly agree;
    int8 weights (the indexer's projections as the attention's of their width) are batch-invariant and mostly
    agree."""
    folder = save_family(tmp_path, "deepseek-v32", head_spread=1.0)  # a clear next token (families.save_family)
    theirs, batch = reference_tokens(folder), prompts()
    with engine(folder, chunk=24, kv_blocks=36) as llm:  # 36 of the helper's blocks hold 24 of these 48-dim rows
        assert llm.core.runner.kv_caches[0].shape[2:] == (16, 1, 48)
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
        assert llm.core.scheduler.total_preemptions > 0
    speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
    with engine(folder, speculative_config=speculative) as llm:
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
    config = EngineConfig(model=str(folder), device="cpu", quantization="none",
                          cache=CacheConfig(memory_bytes=64 * 1024**2, dtype="fp8"))  # fmt: skip
    with LLM(config=config) as llm:
        assert {(c.shape[-1], c.dtype) for c in llm.core.runner.kv_caches} == {(48 + 4, torch.uint8)}
        ours = tokens(llm, batch)
    # e4m3 rows move this tiny model's first tokens as they move DeepSeek-V3's (6 of 8 here; the sparse path's
    # reads of those rows are held to the float formula in tests/unit/test_sparse_indexer.py)
    assert sum(a[0] == b for a, b in zip(ours, theirs.first_tokens(), strict=True)) >= 5
    with engine(folder, quantization="int8") as llm:
        attention = llm.core.runner.loaded.model.model.layers[0].self_attn
        indexer = attention.indexer  # (wq_b reads the 48-wide low-rank query, float as q_b_proj is: not in 32s)
        assert isinstance(indexer.wk, QuantizedLinear) and isinstance(indexer.weights_proj, QuantizedLinear)
        assert type(indexer.wq_b) is type(attention.q_b_proj) and not isinstance(indexer.wq_b, QuantizedLinear)
        alone = [tokens(llm, [prompt])[0] for prompt in batch]
        assert tokens(llm, batch) == alone
    assert sum(a[0] == b for a, b in zip(alone, theirs.first_tokens(), strict=True)) >= 7


def test_hy_v4_chunked_preempted_split_and_on_int8(tmp_path: Path) -> None:
    """HY-V4 (tests/families.py: four residual streams, 16 positions per query from its indexer, a sink per head)
    keeps transformers' tokens with prompts prefilled in 24-token chunks on a pool of 24 blocks (sequences preempted
    and recomputed), and over two ranks (each its two heads' value-gate rows and sinks, the streams' maps whole on
    both). On int8 weights its experts run the C++ kernel with the clamped SwiGLU without the up offset (changed to
    gpt-oss's offset, the tokens move): each prompt's tokens the same alone and batched, and most of transformers'
    first ones (5 of 8 measured: on the prompts longer than the indexer's 16 positions, 8-bit noise flips which
    positions it picks, and this random model's logits then move by tens, with rope over halves as over interleaved
    pairs; the shorter prompts move by 2-4 and keep their tokens)."""
    folder = save_family(tmp_path, "hy-v4", head_spread=1.0)  # a clear next token (families.save_family)
    theirs, batch = reference_tokens(folder), prompts()
    with engine(folder, chunk=24, kv_blocks=36) as llm:
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
        assert llm.core.scheduler.total_preemptions > 0
    with engine(folder, tensor_parallel_size=2) as llm:
        attention = llm.core.runner.loaded.model.model.layers[1].self_attn
        assert isinstance(attention, MultiLatentAttention) and attention.sinks is not None
        assert attention.sinks.shape == (2,)
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
    with engine(folder, quantization="int8") as llm:
        experts = llm.core.runner.loaded.model.model.layers[1].mlp.experts
        assert isinstance(experts, QuantizedExperts) and experts.swiglu == (1.0, 1.0, 0.0)
        alone = [tokens(llm, [prompt])[0] for prompt in batch]
        assert tokens(llm, batch) == alone
        experts.swiglu = (1.0, 1.0, 1.0)
        assert [tokens(llm, [prompt])[0] for prompt in batch] != alone
    assert sum(ours[0] == first for ours, first in zip(alone, theirs.first_tokens(), strict=True)) >= 5


@pytest.mark.parametrize(
    ("name", "banks"), [("glm4-moe", 3), ("minimax-m2", 4), ("ernie4.5-moe", 3), ("laguna", 3), ("kolibri1", 4)]
)
def test_bias_routed_families_split_over_two_ranks_and_on_int8(name: str, banks: int, tmp_path: Path) -> None:
    """GLM-4.5, MiniMax-M2, Laguna, Kolibri-1 (sigmoid scores; Kolibri-1's bias on the logits) and ERNIE 4.5
    (softmax), each choosing its experts with a load-balancing bias: two ranks keep transformers' tokens (each rank
    its heads' q/k/v rows, GLM-4.5's biases and per-head q/k norms, MiniMax-M2's q/k norms over every head summing
    their squares over the ranks, ERNIE's interleaved rope rows reordered before the split, Laguna's gate rows of its
    heads; its rows of every expert). int8 quantizes the projections and every sparse layer's bank (the first layer
    is dense but in MiniMax-M2 and Kolibri-1; the router float, routed row by row); each prompt's tokens are the same
    alone and batched, and mostly agree with the float path's."""
    folder = save_family(tmp_path, name, head_spread=1.0)  # a clear next token (families.save_family)
    theirs, batch = reference_tokens(folder), prompts()
    with engine(folder, tensor_parallel_size=2) as llm:
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
    with engine(folder, quantization="int8") as llm:
        model = llm.core.runner.loaded.model
        assert sum(isinstance(module, QuantizedExperts) for module in model.modules()) == banks
        alone = [tokens(llm, [prompt])[0] for prompt in batch]
        assert tokens(llm, batch) == alone
    assert sum(ours[0] == first for ours, first in zip(alone, theirs.first_tokens(), strict=True)) >= 7


def test_olmoe_on_int8_over_two_ranks_is_batch_invariant_and_close(tmp_path: Path) -> None:
    """OLMoE on int8 over two ranks: its q/k norms over every head sum their squares over the ranks in the layers
    (`ShardedRMSNorm`; no C++ decode stack, whose norms would see one rank's heads); each prompt's tokens are the
    same alone and batched and mostly agree with the float path's."""
    folder = save_family(tmp_path, "olmoe", head_spread=1.0)  # a clear next token (families.save_family)
    theirs, batch = reference_tokens(folder), prompts()
    with engine(folder, quantization="int8", tensor_parallel_size=2) as llm:
        assert llm.core.runner.loaded.model.model.decode_stack is None
        alone = [tokens(llm, [prompt])[0] for prompt in batch]
        assert tokens(llm, batch) == alone
    assert sum(ours[0] == first for ours, first in zip(alone, theirs.first_tokens(), strict=True)) >= 7


def test_llama4_chunks_must_be_whole_blocks_past_the_first(tmp_path: Path) -> None:
    """Llama 4's rope layers attend within chunks (tests/families.py: of 32 positions, which the family tests cross):
    a chunk the KV block size does not divide is served only as far as the first chunk, and refused past it before
    anything loads."""
    folder = save_family(tmp_path, "llama4", attention_chunk_size=40)
    past = EngineConfig(model=str(folder), device="cpu", quantization="none", cache=CacheConfig(memory_bytes=64 << 20))
    with pytest.raises(ValueError, match=r"chunks of 40 positions, which the KV block size 16 does not divide"):
        LLM(config=past)
    within = dataclasses.replace(past, scheduler=SchedulerConfig(max_model_len=40))
    with LLM(config=within) as llm:
        assert tokens(llm, [list(range(10, 20))])[0]



def test_deepseek_v4_chunked_preempted_quantized_and_refusing_what_it_lacks(tmp_path: Path) -> None:
    """DeepSeek-V4 (tests/families.py: HCA, CSA and sliding layers, hash-routed first experts, mHC streams) keeps
    transformers' tokens prefilled in 16-token chunks (windows closing in one chunk pool rows another wrote) and
    preempted from a small pool (a recomputed sequence rewrites its rows and entries), and under n-gram speculation
    (a rejected draft token's rows, and the entry of a window it closed, are written again by the token that
    replaces it). On int8 weights each
    prompt's tokens are the same alone and batched, and mostly agree with the float path's first tokens. Tensor
    parallelism, LoRA and an FP8 cache are refused saying so."""
    folder = save_family(tmp_path, "deepseek-v4", head_spread=0.5)  # a clear head: no near-ties for int8 to flip
    theirs, batch = reference_tokens(folder), prompts()
    with engine(folder, chunk=16, kv_blocks=48) as llm:
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
        assert llm.core.scheduler.total_preemptions > 0
    speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
    with engine(folder, speculative_config=speculative) as llm:  # rejected drafts' rows and entries written again
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
        stats = llm.core.speculator.stats  # type: ignore[union-attr]
        assert stats.proposed_tokens > stats.accepted_tokens > 0  # drafts kept, and some rejected
    with engine(folder, quantization="int8") as llm:
        layer = llm.core.runner.loaded.model.model.layers[1]
        assert isinstance(layer.self_attn.q_a_proj, QuantizedLinear)
        alone = [tokens(llm, [prompt])[0] for prompt in batch]
        assert tokens(llm, batch) == alone
    assert sum(ours[0] == first for ours, first in zip(alone, theirs.first_tokens(), strict=True)) >= 6
    with pytest.raises(ValueError, match="tensor parallelism"):
        engine(folder, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="fp8 is not served on DeepSeek-V4"):
        LLM(config=EngineConfig(model=str(folder), device="cpu", quantization="none",
                                cache=CacheConfig(memory_bytes=1 << 24, dtype="fp8")))  # fmt: skip
    with pytest.raises(ValueError, match="LoRA adapters are not applied to DeepSeek-V4"):
        LLM(config=EngineConfig(model=str(folder), device="cpu", quantization="none", lora=LoraConfig()))


def chunked_split_and_int8(
    folder: Path, quantized: Callable[[Any], nn.Module], split: bool = True, kv_blocks: int = 24
) -> None:
    """A family's engine runs against transformers' greedy tokens (`reference_tokens`): prefilled in 16-token chunks
    on a small pool (`engine`'s `kv_blocks`: preempted), over two ranks where `split`, and on int8
    (`quantized(model)`, the module the family quantizes its own way, a `QuantizedLinear` or `QuantizedExperts`) each
    prompt's tokens the same alone and batched, 6+ of 8 first tokens the float path's."""
    theirs, batch = reference_tokens(folder), prompts()
    with engine(folder, chunk=16, kv_blocks=kv_blocks) as llm:
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
        assert llm.core.scheduler.total_preemptions > 0
    if split:
        with engine(folder, tensor_parallel_size=2) as llm:
            ours = tokens(llm, batch)
            assert ours == theirs.of(ours)
    with engine(folder, quantization="int8") as llm:
        assert isinstance(quantized(llm.core.runner.loaded.model), QuantizedLinear | QuantizedExperts)
        alone = [tokens(llm, [prompt])[0] for prompt in batch]
        assert tokens(llm, batch) == alone
    assert sum(ours[0] == first for ours, first in zip(alone, theirs.first_tokens(), strict=True)) >= 6


def test_longcat_flash_split_chunked_and_on_int8(tmp_path: Path) -> None:
    """LongCat-Flash (tests/families.py: latent-attention blocks in pairs beside each pair's experts, four of its
    router's twelve choices zero-computation ones) keeps transformers' tokens prefilled in 16-token chunks and
    preempted, and over two ranks (each its heads of every block and its rows of every expert; the zero experts'
    share of each input added once, after the ranks' sum). On int8 each prompt's tokens are the same alone and
    batched."""
    folder = save_family(tmp_path, "longcat-flash", head_spread=0.5)
    chunked_split_and_int8(folder, lambda model: model.model.layers[0].shortcut.experts)


def test_minimax_m3_chunked_preempted_speculated_quantized_split_and_refusing_what_it_lacks(tmp_path: Path) -> None:
    """MiniMax-M3 (tests/families.py: block-sparse layers keeping 4 blocks of 4 positions a query) keeps
    transformers' tokens prefilled in 16-token chunks (a chunk's queries choosing among blocks an earlier chunk wrote)
    and preempted from a small pool (a recomputed sequence rewrites its index keys), and under n-gram speculation (a
    rejected draft's index key written again by the token that replaces it). On int8 weights, and over an FP8 cache
    (its index keys e4m3 too), each prompt's tokens are the same alone and batched and mostly agree with the float
    path's first tokens. Over two ranks (each its query heads, its KV head and its index head, every token's index
    key in both caches) too; four ranks, which would split its two index heads, and LoRA are refused saying so."""
    folder = save_family(tmp_path, "minimax-m3", head_spread=0.5)  # a clear head: no near-ties for int8 to flip
    theirs, batch = reference_tokens(folder), prompts()
    with engine(folder, chunk=16, kv_blocks=24) as llm:
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
        assert llm.core.scheduler.total_preemptions > 0
    speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
    with engine(folder, speculative_config=speculative) as llm:
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
        stats = llm.core.speculator.stats  # type: ignore[union-attr]
        assert stats.proposed_tokens > stats.accepted_tokens > 0  # drafts kept, and some rejected
    fp8_cache = EngineConfig(model=str(folder), device="cpu", quantization="none",
                             cache=CacheConfig(memory_bytes=1 << 24, dtype="fp8"))  # fmt: skip
    for quantized in (lambda: engine(folder, quantization="int8"), lambda: LLM(config=fp8_cache)):
        with quantized() as llm:
            alone = [tokens(llm, [prompt])[0] for prompt in batch]
            assert tokens(llm, batch) == alone
        assert sum(ours[0] == first for ours, first in zip(alone, theirs.first_tokens(), strict=True)) >= 6
    with engine(folder, tensor_parallel_size=2) as llm:  # a rank's query heads, KV head and index head
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
    with pytest.raises(ValueError, match="MiniMax-M3's 2 index heads do not split over 4 tensor-parallel ranks"):
        engine(folder, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="LoRA adapters are not applied to MiniMax-M3"):
        LLM(config=EngineConfig(model=str(folder), device="cpu", quantization="none", lora=LoraConfig()))


def test_diffllama_chunked_preempted_on_int8_and_refusing_what_it_lacks(tmp_path: Path) -> None:
    """DiffLlama (tests/families.py: differential attention in torch over the paged cache) keeps transformers' tokens
    prefilled in 16-token chunks on a small pool (preempted); on int8 each prompt's tokens are the same alone and
    batched and mostly agree with the float path's first tokens. Tensor parallelism and LoRA are refused saying so."""
    folder = save_family(tmp_path, "diffllama", head_spread=1.0)
    chunked_split_and_int8(folder, lambda model: model.model.layers[0].self_attn.qkv_proj, split=False)
    with pytest.raises(ValueError, match="DiffLlama's differential attention is not served under tensor parallel"):
        engine(folder, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="LoRA adapters are not applied to DiffLlama's differential attention"):
        LLM(config=EngineConfig(model=str(folder), device="cpu", quantization="none", lora=LoraConfig()))


def test_kolibri1_1_chunked_preempted_speculated_on_int8_and_refusing_what_it_lacks(tmp_path: Path) -> None:
    """Kolibri-1.1 (tests/families.py: indexed layers over one layer's K/V choosing from two pool layers' pools)
    keeps transformers' tokens prefilled in 16-token chunks on a small pool (preempted: a recomputed sequence's
    layers choose again), and under n-gram speculation (drafts rejected). On int8 each prompt's tokens are the same
    alone and batched and mostly agree with the float path's first tokens. Tensor parallelism and LoRA are refused
    saying so."""
    folder = save_family(tmp_path, "kolibri1.1", head_spread=1.0)  # a clear head: its NVFP4 keys round coarsely
    chunked_split_and_int8(folder, lambda model: model.model.layers[1].mlp.experts, split=False, kv_blocks=16)
    theirs, batch = reference_tokens(folder), prompts()
    speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
    with engine(folder, speculative_config=speculative) as llm:
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
        stats = llm.core.speculator.stats  # type: ignore[union-attr]
        assert stats.proposed_tokens > stats.accepted_tokens > 0
    with pytest.raises(ValueError, match=r"Kolibri-1\.1's indexed attention is not served under tensor parallel"):
        engine(folder, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"LoRA adapters are not applied to Kolibri-1\.1's indexed attention"):
        LLM(config=EngineConfig(model=str(folder), device="cpu", quantization="none", lora=LoraConfig()))


# transformers' names of MiniMax-M3's parts and the released checkpoint's, in the order they are replaced.
_RELEASED_MINIMAX_M3 = (
    (".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias"),
    (".mlp.gate.", ".block_sparse_moe.gate."),
    (".mlp.shared_experts.", ".block_sparse_moe.shared_experts."),
    (".self_attn.indexer.", ".self_attn.index_"),
)


def _released_minimax_m3(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """One tensor of transformers' MiniMax-M3 file under the released checkpoint's names (transformers' conversion,
    reversed): the multimodal text model's prefix, experts one by one as `w1` / `w3` / `w2` under `block_sparse_moe`,
    gate and up apart, the indexer's parts on the attention."""
    name = name.replace("model.", "language_model.model.", 1) if name.startswith("model.") else f"language_model.{name}"
    for theirs, released in _RELEASED_MINIMAX_M3:
        name = name.replace(theirs, released)
    if name.endswith(".mlp.experts.gate_up_proj"):
        bank = name.replace(".mlp.experts.gate_up_proj", ".block_sparse_moe.experts")
        pieces = {}
        for expert, rows in enumerate(tensor):
            gate, up = rows.chunk(2)
            pieces |= {f"{bank}.{expert}.w1.weight": gate, f"{bank}.{expert}.w3.weight": up}
        return pieces
    if name.endswith(".mlp.experts.down_proj"):
        bank = name.replace(".mlp.experts.down_proj", ".block_sparse_moe.experts")
        return {f"{bank}.{expert}.w2.weight": rows for expert, rows in enumerate(tensor)}
    if name.endswith("gate_up_proj.weight"):
        gate, up = tensor.chunk(2)
        return {name.replace("gate_up_proj", "gate_proj"): gate, name.replace("gate_up_proj", "up_proj"): up}
    return {name: tensor}


def test_a_minimax_m3_checkpoint_in_its_released_layout_serves_its_text_model(tmp_path: Path) -> None:
    """A multimodal MiniMax-M3 checkpoint as released: `minimax_m3_vl` with its text model's config under
    `text_config` in the released keys (`sparse_attention_config`, `moe_layer_freq`, `rotary_dim`, `swigluoai`), its
    tensors under the released names (`_released_minimax_m3`), a vision tower, projector and multi-token-prediction
    module beside them (not read): transformers' greedy tokens of the text model."""
    folder = save_family(tmp_path, "minimax-m3", head_spread=0.5)
    theirs = reference_tokens(folder)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        state |= _released_minimax_m3(name, tensor)
    state |= {"vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight": torch.zeros(8, 8),
              "multi_modal_projector.linear_1.weight": torch.zeros(8, 8),
              "language_model.model.mtp.layers.0.eh_proj.weight": torch.zeros(8, 8)}  # fmt: skip
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((folder / "config.json").read_text())
    released = {key: value for key, value in text.items()
                if not key.startswith("index_") and key not in ("layer_types", "mlp_layer_types", "rope_parameters")}
    released |= {
        "hidden_act": "swigluoai", "rotary_dim": 8, "rope_theta": text["rope_parameters"]["rope_theta"],
        "sparse_attention_config": {"sparse_attention_freq": [0, 1, 1, 1], "sparse_num_index_heads": 2,
                                    "sparse_index_dim": 16, "sparse_block_size": 4, "sparse_topk_blocks": 4,
                                    "sparse_local_block": 1},
        "moe_layer_freq": [0, 1, 1, 1],
    }  # fmt: skip
    config = {"model_type": "minimax_m3_vl", "text_config": released, "vision_config": {"hidden_size": 8}}
    (folder / "config.json").write_text(json.dumps(config))
    with engine(folder) as llm:
        assert llm.core.model_config.architecture == "minimax_m3"
        ours = tokens(llm, prompts())
        assert ours == theirs.of(ours)


def test_beam_split_chunked_and_on_int8(tmp_path: Path) -> None:
    """Beam (tests/families.py: gated heads, windowed rope layers and NoPE full ones, depth-scaled sandwich blocks,
    grouped routing) keeps transformers' tokens prefilled in 16-token chunks and preempted, and over two ranks (each
    its heads' gates and their biases, its rows of every expert). On int8 each prompt's tokens are the same alone and
    batched and mostly agree with the float path's first tokens."""
    folder = save_family(tmp_path, "beam", head_spread=0.5)
    chunked_split_and_int8(folder, lambda model: model.model.layers[1].mlp.experts)


def test_ergo_split_chunked_and_on_int8(tmp_path: Path) -> None:
    """Ergo (tests/families.py: gated residual adds, windowed rope layers over interleaved pairs and NoPE full ones,
    relu² experts each normalised) keeps transformers' tokens prefilled in 16-token chunks and preempted, and over
    two ranks (each route's output summed over the ranks before its expert's norm, the shared expert's before its
    own). On int8 each prompt's tokens are the same alone and batched and mostly agree with the float path's first
    tokens."""
    folder = save_family(tmp_path, "ergo", head_spread=0.5)
    chunked_split_and_int8(folder, lambda model: model.model.layers[1].mlp.experts)


def _saved_gemma4_assistant(folder: Path, clusters: int) -> Path:
    """A random Gemma 4 assistant for tests/families.py's Gemma 4 (64 wide; its windowed layers' K/V 2 heads of 16,
    its full ones' 1 of 32): 32 wide, a windowed layer and a full one, its embeddings ordered in `clusters` clusters
    (a random permutation of the vocabulary; 0: not ordered), weights drawn as `families.save_family` draws them."""
    import transformers

    text = transformers.Gemma4TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=WINDOW,
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, use_double_wide_mlp=False, max_position_embeddings=1024,
    )  # fmt: skip
    config = transformers.Gemma4AssistantConfig(
        text_config=text.to_dict(), backbone_hidden_size=64, use_ordered_embeddings=clusters > 0,
        num_centroids=clusters or 2048, centroid_intermediate_top_k=4,
    )  # fmt: skip
    torch.manual_seed(1)
    model = transformers.Gemma4AssistantForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.08)
            elif "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
        if model.masked_embedding is not None:
            model.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB_SIZE))
    model.save_pretrained(folder)
    return folder


def _transformers_drafts(target: Any, assistant: Any, prompt: list[int], count: int) -> list[int]:
    """transformers' first round of drafts after `prompt` (`SinglePositionMultiTokenCandidateGenerator.get_candidates`
    after the target's prefill): the target's greedy token, then `count` drafts from its hidden state and K/V."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = target(ids, output_hidden_states=True, return_shared_kv_states=True)
        token = out.logits[:, -1:].argmax(-1)
        hidden, position = out.hidden_states[-1][:, -1:], torch.tensor([[len(prompt)]])
        drafts = []
        for _ in range(count):
            embedded = torch.cat([target.get_input_embeddings()(token), hidden], dim=-1)
            step = assistant(inputs_embeds=embedded, attention_mask=torch.ones(1, len(prompt) + 1, dtype=torch.long),
                             position_ids=position, shared_kv_states=out.shared_kv_states, use_cache=False)  # fmt: skip
            token, hidden = step.logits.argmax(-1), step.last_hidden_state
            drafts.append(int(token))
    return drafts


@pytest.mark.parametrize("clusters", [0, 64])
def test_a_gemma4_assistant_drafts_as_transformers_does_and_the_target_keeps_its_tokens(
    clusters: int, tmp_path: Path
) -> None:
    """A Gemma 4 assistant as the draft model (`speculative.gemma4_assistant`: over the target's K/V of its last
    unshared windowed and full layers and its final hidden state), its embeddings ordered in clusters or not: its
    first drafts after a prompt are transformers' (`SinglePositionMultiTokenCandidateGenerator`), the target's tokens
    are transformers' greedy ones alone and batched (and on int8 its own without drafts), and it is refused as a model
    served alone."""
    import transformers

    folder = save_family(tmp_path / "target", "gemma4", head_spread=0.5)
    helper = _saved_gemma4_assistant(tmp_path / "assistant", clusters)
    theirs, batch = reference_tokens(folder), prompts()
    spec = {"method": "draft_model", "model": str(helper), "num_speculative_tokens": 3}
    with engine(folder, speculative_config=spec) as llm:
        drafter = llm.core.runner.draft
        assert drafter is not None
        proposed: list[tuple[int, ...]] = []
        propose = drafter.propose

        def recorded(items: Any) -> list[tuple[int, ...]]:
            drafts = propose(items)
            proposed.extend(drafts)
            return drafts

        drafter.propose = recorded  # type: ignore[method-assign]
        alone = tokens(llm, batch[:1])
        assert alone == theirs.of(alone)
        first = proposed[0]
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
        stats = llm.core.speculator.stats  # type: ignore[union-attr]
        assert stats.proposed_tokens > 0
    target = load_reference(folder)
    assistant = transformers.Gemma4AssistantForCausalLM.from_pretrained(helper).eval()
    assert list(first) == _transformers_drafts(target, assistant, batch[0], 3)
    with engine(folder, quantization="int8") as llm:  # the quantized target: drafting changes none of its tokens
        plain = tokens(llm, batch)
    with engine(folder, quantization="int8", speculative_config=spec) as llm:
        assert tokens(llm, batch) == plain
    with pytest.raises(ValueError, match="is a Gemma 4 assistant"):
        copy_tokenizer(helper)
        engine(helper)


def test_jetmoe_chunked_preempted_on_int8_and_refusing_what_it_lacks(tmp_path: Path) -> None:
    """JetMoE (tests/families.py: mixtures of attention and MLP experts) keeps transformers' tokens prefilled in
    16-token chunks and preempted. On int8 (each attention expert's projections quantized like any linear layer)
    each prompt's tokens are the same alone and batched and mostly agree with the float path's first tokens. Tensor
    parallelism and LoRA are refused saying so."""
    folder = save_family(tmp_path, "jetmoe", head_spread=0.5)
    chunked_split_and_int8(folder, lambda model: model.model.layers[0].self_attn.q_experts[0], split=False)
    with pytest.raises(ValueError, match="JetMoE's mixture of attention is not served under tensor parallelism"):
        engine(folder, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="LoRA adapters are not applied to JetMoE"):
        LLM(config=EngineConfig(model=str(folder), device="cpu", quantization="none", lora=LoraConfig()))


def test_bloom_split_chunked_and_on_int8(tmp_path: Path) -> None:
    """BLOOM (tests/families.py: ALiBi, attended in torch sequence by sequence) keeps transformers' tokens prefilled
    in 16-token chunks (a chunk's distances from its cached context) and preempted, and over two ranks (each its
    heads' slopes). On int8 each prompt's tokens are the same alone and batched."""
    folder = save_family(tmp_path, "bloom", head_spread=0.5)
    chunked_split_and_int8(folder, lambda model: model.model.layers[0].mlp.up_proj, kv_blocks=48)  # (4 KV heads)


@pytest.mark.parametrize(("name", "kv_blocks"), [("mpt", 72), ("falcon-rw", 48)])  # (24 blocks of 6 or 16 heads)
def test_mpt_and_falcon_rw_split_chunked_and_on_int8(tmp_path: Path, name: str, kv_blocks: int) -> None:
    """MPT and Falcon-RW (tests/families.py: ALiBi with MPT's slopes; BLOOM's in bfloat16 scaled with the scores)
    keep transformers' tokens prefilled in 16-token chunks and preempted, over two ranks (each its heads' slopes) and
    under n-gram speculation. On int8 each prompt's tokens are the same alone and batched."""
    folder = save_family(tmp_path, name, head_spread=0.5)
    chunked_split_and_int8(folder, lambda model: model.model.layers[0].mlp.up_proj, kv_blocks=kv_blocks)
    speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
    with engine(folder, speculative_config=speculative) as llm:  # drafts verified as rows of several queries
        ours = tokens(llm, prompts())
        assert ours == reference_tokens(folder).of(ours)


@pytest.mark.parametrize("name", ["opt-350m", "openai-gpt"])
def test_post_layer_norm_models_split_chunked_and_on_int8(tmp_path: Path, name: str) -> None:
    """OPT-350M's form and GPT-1 (tests/families.py: post-LN blocks, no final norm; OPT-350M's embeddings projected in
    and out) keep transformers' tokens prefilled in 16-token chunks and preempted, over two ranks and under n-gram
    speculation; on int8 each prompt's tokens are the same alone and batched."""
    folder = save_family(tmp_path, name, head_spread=0.5)
    chunked_split_and_int8(folder, lambda model: model.model.layers[0].mlp.up_proj, kv_blocks=48)  # (4 KV heads)
    speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
    with engine(folder, speculative_config=speculative) as llm:
        ours = tokens(llm, prompts())
        assert ours == reference_tokens(folder).of(ours)


def test_a_gpt1_checkpoint_without_its_prefix_equals_transformers(tmp_path: Path) -> None:
    """GPT-1's released checkpoint (openai-community/openai-gpt) names its tensors without `transformer.`
    (`tokens_embed`, `positions_embed`, `h.N.`): read as transformers reads them."""
    folder = save_family(tmp_path, "openai-gpt", head_spread=0.5)
    saved = load_file(folder / "model.safetensors")
    state = {name.removeprefix("transformer."): tensor for name, tensor in saved.items()}
    assert "tokens_embed.weight" in state and "h.0.attn.c_attn.weight" in state
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with engine(folder) as llm:
        ours = tokens(llm, prompts())
        assert ours == reference_tokens(folder).of(ours)


def test_a_bloom_checkpoint_without_its_prefix_equals_transformers(tmp_path: Path) -> None:
    """BLOOM's first checkpoints (bigscience's) name their tensors without `transformer.`: read as transformers reads
    them."""
    folder = save_family(tmp_path, "bloom", head_spread=0.5)
    saved = load_file(folder / "model.safetensors")
    state = {name.removeprefix("transformer."): tensor for name, tensor in saved.items()}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with engine(folder) as llm:
        ours = tokens(llm, prompts())
        assert ours == reference_tokens(folder).of(ours)


def test_dory_chunked_preempted_on_int8_and_refusing_what_it_lacks(tmp_path: Path) -> None:
    """Dory (tests/families.py: its recurrent section's three passes each a KV cache of its own) keeps transformers'
    tokens prefilled in 16-token chunks and preempted, and under n-gram speculation; on int8 each prompt's tokens are
    the same alone and batched. Tensor parallelism and LoRA adapters are refused by name."""
    folder = save_family(tmp_path, "dory", head_spread=0.5)
    chunked_split_and_int8(folder, lambda model: model.model.layers[0].mlp.gate_up_proj, split=False, kv_blocks=48)
    speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
    with engine(folder, speculative_config=speculative) as llm:  # drafts verified through every pass's cache
        ours = tokens(llm, prompts())
        assert ours == reference_tokens(folder).of(ours)
    with pytest.raises(ValueError, match="Dory is not served under tensor parallelism yet"):
        engine(folder, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="LoRA adapters are not applied to Dory's nGPT blocks"):
        LLM(config=EngineConfig(model=str(folder), device="cpu", quantization="none", lora=LoraConfig()))


def test_a_dory_checkpoint_in_its_released_layout_equals_transformers(tmp_path: Path) -> None:
    """Dory's released checkpoints hold each layer as a pair of blocks (`backbone.layers.{2i}.mixer.` the attention,
    `backbone.layers.{2i+1}.mixer.` the MLP, their rates `attn_alpha` and `mlp_alpha`; the gate `g_proj`), as
    transformers' `LayerPairCollapse` reads them: read so, the engine keeps transformers' tokens."""
    folder = save_family(tmp_path, "dory", head_spread=0.5)
    paired = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        layer = re.fullmatch(r"backbone\.layers\.(\d+)\.(self_attn|mlp|lambda_1|lambda_2)(.*)", name)
        if layer is not None:
            index, part, rest = int(layer[1]), layer[2], layer[3]
            block = 2 * index + (part in ("mlp", "lambda_2"))
            module = {"lambda_1": "attn_alpha", "lambda_2": "mlp_alpha"}.get(part, "mixer")
            name = f"backbone.layers.{block}.{module}{rest}"
        paired[name] = tensor
    assert "backbone.layers.1.mixer.up_proj.weight" in paired and "backbone.layers.0.mixer.g_proj.weight" in paired
    save_file(paired, folder / "model.safetensors", metadata={"format": "pt"})
    with engine(folder) as llm:
        ours = tokens(llm, prompts())
        assert ours == reference_tokens(folder).of(ours)
