"""Qwen3.5, Qwen3-Next and LFM2 served whole by the engine: hybrids whose Gated DeltaNet layers
(`layers.gated_deltanet`), or LFM2's short convolutions (`layers.short_conv`), keep a state per running request beside
the paged KV cache of their full-attention layers. Greedy output equals
transformers' token for token on the float path alone, batched, prefilled in chunks, after preemption (each a
different history of the state slots: a slot's last holder always left its state there) and from a prefix snapshot
(`core.state_snapshots`); the quantized path is
batch-invariant; tensor parallelism splits the linear layers by heads; a multimodal Qwen3.5 checkpoint serves its
text model; what these models cannot do yet is refused by name. The models are tiny random ones saved by
transformers (tests/families.py); LoRA adapters are PEFT's (tests/lora_adapters.py)."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_server import LLM, SamplingParams, model_loading
from engine_server.attention_metadata import kv_cache_bytes_per_block, recurrent_state_bytes
from engine_server.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
from engine_server.hf_config import model_config_from_hf
from engine_server.layers.attention import PagedSelfAttention
from engine_server.layers.gated_deltanet import GatedDeltaNet
from engine_server.layers.kimi_delta import KimiDeltaAttention
from engine_server.layers.lightning_attention import LightningAttention
from engine_server.layers.mamba1 import Mamba1Mixer
from engine_server.layers.mamba2 import Mamba2Mixer
from engine_server.layers.mlstm import MLstmMixer
from engine_server.layers.quantized_linear import QuantizedLinear
from engine_server.layers.rg_lru import RecurrentBlock
from engine_server.layers.rwkv import RwkvLayer
from engine_server.layers.short_conv import ShortConv
from engine_server.loader.source import ModelSource
from tests.families import (
    _SHAPE,
    HYBRIDS,
    LINEAR_ATTENTION,
    VOCAB_SIZE,
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
MAX_SEQS = 8  # running seats, so as many state slots
SHARED_PREFIX = 48  # tokens the last prompt shares with the first: a prefix cache would serve them


def prompts() -> list[list[int]]:
    """8 prompts of 1 to 120 tokens (longer than the rule's 64-token chunks, shorter than its 3-input convolution
    history); the last starts with the first's 48 tokens."""
    rng = random.Random(7)
    batch = [[rng.randrange(10, VOCAB_SIZE) for _ in range(length)] for length in (64, 3, 17, 120, 33, 1, 90)]
    return [*batch, batch[0][:SHARED_PREFIX] + [rng.randrange(10, VOCAB_SIZE) for _ in range(20)]]


def engine(
    folder: Path, quantization: str = "none", chunk: int = 2048, kv_blocks: int = 0, snapshots: int | None = None,
    **overrides: Any,
) -> LLM:
    """The offline engine on `folder` with `MAX_SEQS` seats; `chunk`: the most tokens a step prefills; `kv_blocks`:
    a KV cache of that many 16-token blocks (for 256-token sequences) beside the states (the running requests' and
    `MAX_SEQS` prefix snapshots), instead of 64 MiB; `snapshots`: `CacheConfig.state_snapshots`."""
    config = model_config_from_hf(json.loads((folder / "config.json").read_text()))
    memory = 64 * 1024**2
    if kv_blocks:
        states = recurrent_state_bytes(config, MAX_SEQS + (MAX_SEQS if snapshots is None else snapshots))
        memory = states + kv_blocks * kv_cache_bytes_per_block(config, 16, torch.float32)
        snapshots = MAX_SEQS if snapshots is None else snapshots
    cache = CacheConfig(memory_bytes=memory, state_snapshots=snapshots)
    engine_config = EngineConfig(
        model=str(folder), device="cpu", quantization=quantization, cache=cache,
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=MAX_SEQS,
                                  max_model_len=256 if kv_blocks else None),
    )  # fmt: skip
    return LLM(config=engine_config, **overrides)


def tokens(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [result.choices[0].token_ids for result in llm.generate(batch, GREEDY, use_tqdm=False)]


def reference_tokens(model: Any) -> GreedyReference:
    """transformers' greedy tokens for each of `prompts()`, decoded alone (`GreedyReference`: `.of(ours)`)."""
    return GreedyReference(model, prompts(), NUM_TOKENS)


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    """(name, saved folder, transformers' greedy tokens for `prompts()`)."""
    folder = save_family(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, folder, reference_tokens(load_reference(folder))


def test_greedy_equals_transformers_alone_batched_in_chunks_preempted_and_from_the_prefix_cache(
    hybrid: tuple[str, Path, Any],
) -> None:
    """Alone (then its slot serves another request), batched, prefilled 16 tokens a step (a chunk's state carried
    into the next, decode rows beside the chunks), and on a KV pool of 24 blocks for eight sequences (preempted
    requests recompute from a zero state, in whichever slot they get next). From the prefix cache: the first prompt,
    run alone first, saves its states at its last block boundary (48 of its 64 tokens), and in the batch after it
    both it and the last prompt (which shares those 48 tokens) start from that snapshot, copied into their slots
    (but not in the step that saves it); with no snapshot rows nothing is served from the cache. Every slot is free
    once the requests end."""
    name, folder, theirs = hybrid
    batch = prompts()
    with engine(folder) as llm:
        assert llm.core.scheduler.kv_cache.enable_prefix_caching
        layers = llm.core.runner.loaded.model.model.layers
        recurrent = (GatedDeltaNet | KimiDeltaAttention | ShortConv | Mamba2Mixer | Mamba1Mixer | LightningAttention
                     | RecurrentBlock | MLstmMixer)
        if name == "falcon-h1":  # attention beside Mamba-2 in every layer
            assert all(isinstance(layer.self_attn, PagedSelfAttention) and isinstance(layer.mamba, Mamba2Mixer)
                       for layer in layers)  # fmt: skip
        elif name == "rwkv":  # blocks of a time mix and a channel mix, each with a state
            assert all(isinstance(layer, RwkvLayer) for layer in layers) and llm.core.model_config.attention_layers == 0
        elif name in ("zamba2", "zamba"):  # Mamba-2 (Zamba's multi-head Mamba-1) layers; its shared blocks' uses
            # before three, layers of K/V of their own
            config, shared = llm.core.model_config, llm.core.model_config.shared_blocks
            mixer = Mamba2Mixer if name == "zamba2" else Mamba1Mixer
            assert shared is not None and all(isinstance(layer.mamba, mixer) for layer in layers)
            unrolled = shared.layers(len(layers))
            assert [config.is_recurrent_layer(i) for i in range(config.num_hidden_layers)] == [
                not use for _, use in unrolled
            ] and sum(use for _, use in unrolled) == 3
        else:
            config = llm.core.model_config
            assert [isinstance(layer.self_attn, recurrent) for layer in layers] == [
                config.is_recurrent_layer(i) for i in range(len(layers))
            ] and sum(config.is_recurrent_layer(i) for i in range(len(layers))) in (2, 3)
        alone = tokens(llm, batch[:1])
        assert alone == theirs.of(alone), name
        snapshots = llm.core.scheduler.snapshots
        assert snapshots is not None and len(snapshots) == 1 and snapshots.count == MAX_SEQS
        results = llm.generate(batch, GREEDY, use_tqdm=False)
        ours = [result.choices[0].token_ids for result in results]
        assert ours == theirs.of(ours), name
        cached = [result.usage.cached_prompt_tokens for result in results]
        assert cached == [SHARED_PREFIX, 0, 0, 0, 0, 0, 0, SHARED_PREFIX], name
    with engine(folder) as llm:  # in one step: the first saves its states after the step, the last cannot use them
        results = llm.generate([batch[0], batch[-1]], GREEDY, use_tqdm=False)
        assert [result.choices[0].token_ids for result in results] == [theirs.of()[0], theirs.of()[-1]], name
        assert [result.usage.cached_prompt_tokens for result in results] == [0, 0], name
        slots = llm.core.scheduler.state_slots
        assert slots is not None and slots.num_free == MAX_SEQS
    with engine(folder, chunk=16) as llm:
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours), name
    with engine(folder, kv_blocks=24) as llm:  # a model of states alone holds no K/V to run out of
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours), name
        assert (llm.core.scheduler.total_preemptions > 0) == (llm.core.model_config.attention_layers > 0), name
    with engine(folder, snapshots=0) as llm:
        assert not llm.core.scheduler.kv_cache.enable_prefix_caching and llm.core.scheduler.snapshots is None
        alone = tokens(llm, batch[:1])
        assert alone == theirs.of(alone), name
        results = llm.generate(batch, GREEDY, use_tqdm=False)
        ours = [result.choices[0].token_ids for result in results]
        assert ours == theirs.of(ours), name
        assert all(result.usage.cached_prompt_tokens == 0 for result in results)


def test_a_prefix_shared_past_no_snapshot_is_saved_where_the_prompts_part(tmp_path: Path) -> None:
    """Three prompts of a shared 40-token prefix (a system prompt) and 30 tokens of their own: the first saves its
    states only at its last block boundary (64, inside its own tokens), so the second finds the shared blocks (32
    tokens) but no snapshot there: it computes them, and saves its states where the cached prefix ended. The third
    starts from that snapshot. Each equals transformers."""
    folder = save_family(tmp_path, "qwen3.5")
    rng = random.Random(3)
    shared = [rng.randrange(10, VOCAB_SIZE) for _ in range(40)]
    batch = [shared + [rng.randrange(10, VOCAB_SIZE) for _ in range(30)] for _ in range(3)]
    model = load_reference(folder)
    with engine(folder) as llm:
        results = [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for prompt in batch]
        ours = [result.choices[0].token_ids for result in results]
        assert ours == GreedyReference(model, batch, NUM_TOKENS).of(ours)
        assert [result.usage.cached_prompt_tokens for result in results] == [0, 0, 32]
        snapshots = llm.core.scheduler.snapshots
        assert snapshots is not None and len(snapshots) == 4  # 64 twice (their own), 32, and 64 of the third


def test_tensor_parallel_hybrids_equal_transformers(hybrid: tuple[str, Path, Any]) -> None:
    """Two ranks: each holds one of the two key heads with its two value heads (their rows of every input
    projection, their channels of the convolution, their states), the gated attention's heads and gates, and for
    Qwen3-Next its experts' share; LFM2's half of the convolution's channels; Granite 4.0 H's half of the Mamba-2
    heads, both reading the one group's B and C, its gated norm's statistic summed over the ranks. Each step's state
    slots and copies (the first prompt's snapshot saved, then restored for it and the last) reach the worker with
    the rest of the step. Zamba2's shared blocks: each rank its heads (and their adapters' rows) and half the MLP."""
    name, folder, theirs = hybrid
    with engine(folder, tensor_parallel_size=2) as llm:
        alone = tokens(llm, prompts()[:1])
        assert alone == theirs.of(alone), name
        results = llm.generate(prompts(), GREEDY, use_tqdm=False)
        ours = [result.choices[0].token_ids for result in results]
        assert ours == theirs.of(ours), name
        assert results[-1].usage.cached_prompt_tokens == SHARED_PREFIX, name


def test_the_quality_benchmarks_reading_of_sequences_equals_transformers_logits(hybrid: tuple[str, Path, Any]) -> None:
    """`ladle bench quality` reads sequences outside the scheduler (`benchmarks.quality.batch_sequence_logits`): a
    prefill of each, then one decode row per token, each sequence in a state slot of its own."""
    from benchmarks.quality import batch_sequence_logits

    name, folder, _ = hybrid
    model = load_reference(folder)
    batch = [prompt[:40] for prompt in prompts()[:4]]
    with engine(folder) as llm:
        ours = batch_sequence_logits(llm, batch, [len(ids) // 2 for ids in batch])
    for ids, logits in zip(batch, ours, strict=True):
        with torch.inference_mode():
            theirs = model(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(logits, theirs, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    "family",
    ["qwen3-next", "lfm2", "granite4-h", "nemotron-h", "nemotron-h-moe", "falcon-h1", "jamba", "lfm3", "olmo-hybrid",
     "lara-mini", "falcon-mamba", "mamba2", "minimax", "recurrent-gemma", "zamba2", "qwen4-exp", "xlstm", "rwkv",
     "zamba"],
)
def test_the_quantized_path_is_batch_invariant(tmp_path: Path, family: str) -> None:
    """int8 weights (the experts in the C++ expert kernel, the linear layers' core in the C++ kernel, every
    transcendental op by row, the shared expert's gate too; LFM2's convolutions elementwise): each prompt's tokens and
    their log-probabilities are the same alone, batched, prefilled in chunks of 24 and with no prefix cache (so the
    restored snapshots' states are those computed from the first token), bit for bit, and mostly agree with the float
    path's first tokens."""
    folder = save_family(tmp_path, family, head_spread=0.5)  # a clear head: no near-ties for int8 to flip
    theirs = reference_tokens(load_reference(folder))
    batch = prompts()
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)

    def read(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        results = llm.generate(prompts, with_logprobs, use_tqdm=False)
        return [(r.choices[0].token_ids, [lp.logprob for lp in r.choices[0].logprobs or []]) for r in results]

    with engine(folder, quantization="int8") as llm:
        assert llm.core.runner.loaded.model.model.decode_stack is None
        alone = [read(llm, [prompt])[0] for prompt in batch]
        assert read(llm, batch) == alone
    with engine(folder, quantization="int8", chunk=24) as llm:
        assert read(llm, batch) == alone
    with engine(folder, quantization="int8", snapshots=0) as llm:  # from their first token: as from a snapshot
        assert read(llm, batch) == alone
    agree = sum(ours[0][0] == first for ours, first in zip(alone, theirs.first_tokens(), strict=True))
    assert agree >= 6


@pytest.mark.parametrize(
    ("family", "gates"),
    [("kimi-linear", ("f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj")), ("ling-3", ("f_proj", "g_proj"))],
)
def test_kimi_delta_attention_on_int8_quantizes_every_projection_and_agrees_with_the_float_path(
    tmp_path: Path, family: str, gates: tuple[str, ...]
) -> None:
    """int8 weights on every projection of Kimi Linear's and Ling 3's delta-attention layers (q/k/v, the write
    strength, the decay's and the gate's, the output; Ling 3's latent attention's head gate too) beside their latent
    attention's and experts': the first tokens mostly agree with the float path's. (Not batch-invariant, as
    DeepSeek-V3's int8 path is not: the latent expansion stays a float batched product.)"""
    folder = save_family(tmp_path, family, head_spread=0.5)
    theirs = reference_tokens(load_reference(folder))
    with engine(folder, quantization="int8") as llm:
        layers = llm.core.runner.loaded.model.model.layers
        attention = layers[0].self_attn
        assert isinstance(attention, KimiDeltaAttention)
        names = ("qkv_proj", "b_proj", *gates, "o_proj")
        assert all(isinstance(getattr(attention, name), QuantizedLinear) for name in names)
        latent = layers[2].self_attn
        assert (family == "ling-3") == isinstance(getattr(latent, "g_proj", None), QuantizedLinear)
        ours = [ids[0] for ids in tokens(llm, prompts())]
    assert sum(a == b for a, b in zip(ours, theirs.first_tokens(), strict=True)) >= 6


def test_a_bamba_checkpoint_is_served_as_granite_4s_layout(tmp_path: Path) -> None:
    """Bamba (its `attn_layer_indices`, `feed_forward`, `pre_ff_layernorm` and `final_layernorm`, rope over half of
    each head) read as the Granite 4.0 hybrid it is laid out as, without Granite's multipliers: its greedy tokens
    equal transformers' alone and batched (the paged model's chunks: tests/unit/test_models.py)."""
    folder = save_family(tmp_path, "bamba")
    theirs = reference_tokens(load_reference(folder))
    with engine(folder) as llm:
        layers = llm.core.runner.loaded.model.model.layers
        assert [isinstance(layer.self_attn, Mamba2Mixer) for layer in layers] == [True, True, False, True]
        alone = tokens(llm, prompts()[:1])
        assert alone == theirs.of(alone)
        ours = tokens(llm, prompts())
        assert ours == theirs.of(ours)


def _saved_multimodal(model: Any, folder: Path, batch: list[list[int]]) -> GreedyReference:
    """A multimodal `model` with its text model's matrices drawn N(0, 0.08) under seed 0, saved to `folder` with the
    embedded tokenizer: its greedy tokens for `batch`."""
    torch.manual_seed(0)
    model.eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1 and "visual" not in name:
                parameter.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    copy_tokenizer(folder)
    return GreedyReference(model, batch, NUM_TOKENS)


def test_a_multimodal_qwen35_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """The released Qwen3.5 checkpoints are `Qwen3_5ForConditionalGeneration`: a `text_config`, the text model's
    weights under `model.language_model.` and a vision tower beside them, which is not read. Its text output equals
    transformers' own multimodal model's on text prompts."""
    import transformers

    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "num_position_embeddings": 64}  # fmt: skip
    config = transformers.Qwen3_5Config(text_config={**_SHAPE, **LINEAR_ATTENTION}, vision_config=vision)
    batch = prompts()[:4]
    theirs = _saved_multimodal(transformers.Qwen3_5ForConditionalGeneration(config), tmp_path, batch)
    with engine(tmp_path) as llm:
        assert llm.core.model_config.architecture == "qwen3_next"
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)


def test_a_multimodal_qwen4_exp_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """A Qwen4-Exp checkpoint as `Qwen4ExpForConditionalGeneration` saves it: a `text_config` whose attention layers
    are named `full_attention` (as the released config names its indexed ones), the text model's weights under
    `model.language_model.` (each layer's n-gram table in 4 shards), a vision tower beside them, not read. Its text
    output equals transformers' own multimodal model's; a checkpoint whose hash constants are not its config's is
    refused."""
    import transformers

    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "num_position_embeddings": 64}  # fmt: skip
    text = {**_SHAPE, **HYBRIDS["qwen4-exp"][1]}
    text["layer_types"] = ["full_attention" if kind == "indexed_attention" else kind for kind in text["layer_types"]]
    config = transformers.Qwen4ExpConfig(text_config=text, vision_config=vision)
    batch = prompts()[:4]
    theirs = _saved_multimodal(transformers.Qwen4ExpForConditionalGeneration(config), tmp_path, batch)
    with engine(tmp_path) as llm:
        assert llm.core.model_config.architecture == "qwen4_exp"
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["text_config"]["seed"] = 99  # other multipliers than the checkpoint's
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"layer_multipliers .* are not the config's"):
        engine(tmp_path)


def test_a_dummy_hybrid_equals_transformers_holding_its_weights() -> None:
    """`dummy:qwen3.5-tiny`: seeded random weights in Qwen3.5's checkpoint layout, served by the engine, and the
    same weights in transformers' Qwen3.5 (`benchmarks.common.hf_model`, the benchmarks' peer)."""
    assert_dummy_equals_transformers("qwen3.5-tiny", [prompt[:40] for prompt in prompts()[:3]])


@pytest.mark.parametrize("preset", ["mamba-tiny", "mamba2-tiny"])
def test_a_dummy_state_space_model_equals_transformers_holding_its_weights(preset: str) -> None:
    """`dummy:mamba-tiny` and `dummy:mamba2-tiny`: seeded random weights in Mamba's and Mamba-2's checkpoint layout,
    served by the engine, and the same weights in transformers' models of the preset's config (the benchmarks'
    peer)."""
    assert_dummy_equals_transformers(preset, [prompt[:40] for prompt in prompts()[:3]])


def test_lora_adapters_on_a_hybrid_equal_peft(tmp_path: Path) -> None:
    """PEFT's adapter on every attention and MLP projection of a Qwen3.5 (q_proj's query and gate rows alike; the
    linear layers have none of q/k/v/o), beside the base model in one batch, equals PEFT's greedy output; an adapter
    on the linear layers' own projections is refused by name, and the engine serves on."""
    from engine_server.errors import ValidationError
    from tests.lora_adapters import ATTENTION, MLP, load_peft, save_adapter

    base = save_family(tmp_path / "base", "qwen3.5")
    folder = save_adapter(base, tmp_path / "adapter", ATTENTION + MLP, 8, seed=1)
    batch = prompts()[:4]
    theirs = [hf_greedy(load_peft(base, folder), [prompt], NUM_TOKENS)[0] for prompt in batch]
    plain = [hf_greedy(load_reference(base), [prompt], NUM_TOKENS)[0] for prompt in batch]
    assert theirs != plain, "the adapter changes nothing: the test would not see it applied"
    config = EngineConfig(
        model=str(base), device="cpu", quantization="none", cache=CacheConfig(memory_bytes=64 * 1024**2),
        scheduler=SchedulerConfig(max_num_seqs=MAX_SEQS), lora=LoraConfig(max_lora_rank=16),
    )  # fmt: skip
    with LLM(config=config) as llm:
        llm.load_adapter("attention-mlp", str(folder))
        results = llm.generate(batch + batch, GREEDY, adapters=["attention-mlp"] * 4 + [None] * 4, use_tqdm=False)
        assert [result.choices[0].token_ids for result in results] == theirs + plain
        linear = save_adapter(base, tmp_path / "linear", ["in_proj_qkv", "out_proj"], 4, seed=2)
        with pytest.raises(ValidationError, match=r"not 'linear_attn\.in_proj_qkv'"):
            llm.load_adapter("linear", str(linear))
        assert tokens(llm, batch) == plain


def never(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("reached past the refusal")


def test_a_model_of_states_alone_gets_its_blocks_free_once_its_states_fit() -> None:
    """A Mamba keeps no K/V: every seat's longest sequence gets its blocks (at most `MAX_STATE_ONLY_BLOCKS`), whatever
    the memory beyond its states; memory that does not hold the seats' and snapshots' states is refused, saying so."""
    config = model_config_from_hf({**transformers_mamba_config(), "max_position_embeddings": 4096})
    assert kv_cache_bytes_per_block(config, 16, torch.float32) == 0
    states = recurrent_state_bytes(config, 2 * MAX_SEQS)  # the seats' and as many snapshots'
    scheduler = SchedulerConfig(max_num_seqs=MAX_SEQS)
    engine_config = EngineConfig(model="unused", cache=CacheConfig(memory_bytes=states, state_snapshots=MAX_SEQS),
                                 scheduler=scheduler)  # fmt: skip
    assert model_loading.num_kv_blocks(config, engine_config, torch.float32, 4096) == MAX_SEQS * (4096 // 16 + 1)
    long = model_loading.num_kv_blocks(config, engine_config, torch.float32, 1 << 24)
    assert long == (1 << 24) // 16 + 1 > model_loading.MAX_STATE_ONLY_BLOCKS  # one sequence's, past the cap
    short = replace(engine_config, cache=replace(engine_config.cache, memory_bytes=states - 1))
    with pytest.raises(ValueError, match=f"does not hold the {states} B of {2 * MAX_SEQS} recurrent states"):
        model_loading.num_kv_blocks(config, short, torch.float32, 4096)


def transformers_mamba_config() -> dict[str, Any]:
    """The `config.json` of `tests.families`' Falcon Mamba as transformers writes it."""
    import transformers

    class_name, quirks = HYBRIDS["falcon-mamba"]
    return dict(getattr(transformers, class_name)(**{**_SHAPE, **quirks}).to_dict())


def test_what_these_models_cannot_do_yet_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = save_family(tmp_path, "qwen3.5")
    with pytest.raises(ValueError, match=r"linear attention's 2 key and 4 value heads must both be divisible by the "
                                         r"tensor-parallel size \(4\)"):  # fmt: skip
        engine(folder, tensor_parallel_size=4)
    speculative = {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="speculative decoding is not served on models with recurrent layers"):
        engine(folder, speculative_config=speculative)
    config = model_config_from_hf(json.loads((folder / "config.json").read_text()))
    states = recurrent_state_bytes(config, MAX_SEQS)  # the states are set aside before any block
    short = EngineConfig(model=str(folder), device="cpu", quantization="none",
                         cache=CacheConfig(memory_bytes=states + kv_cache_bytes_per_block(config, 16, torch.float32)),
                         scheduler=SchedulerConfig(max_num_seqs=MAX_SEQS, max_model_len=256))  # fmt: skip
    with pytest.raises(ValueError, match=r"holds 1 blocks after the \d+ B of 8 recurrent states \(8 "
                                         r"requests' and the prefix snapshots'"):  # fmt: skip
        LLM(config=short)
    with pytest.raises(ValueError, match=r"holds 0 blocks after the \d+ B of 12 recurrent states"):
        LLM(config=replace(short, cache=replace(short.cache, state_snapshots=4)))  # snapshots set aside too
    with pytest.raises(ValueError, match="state_snapshots must be >= 0, got -1"):
        LLM(config=replace(short, cache=replace(short.cache, state_snapshots=-1)))
    # What no engine serves is refused before a weight is read or a KV cache (2 GiB by default) is allocated.
    monkeypatch.setattr(model_loading, "allocate_kv_cache", never)
    monkeypatch.setattr(ModelSource, "weights", never)
    monkeypatch.setattr(ModelSource, "lazy_weights", never)
    with pytest.raises(ValueError, match="speculative decoding is not served on models with recurrent layers"):
        engine(folder, speculative_config=speculative)
    nemotron = save_family(tmp_path / "nemotron", "nemotron-h")  # its MLPs take no adapter: none is taken at all
    with pytest.raises(ValueError, match=r"LoRA adapters are not applied to Nemotron-H \(its ungated MLPs"):
        LLM(config=EngineConfig(model=str(nemotron), device="cpu", quantization="none", lora=LoraConfig()))
    xlstm = save_family(tmp_path / "xlstm", "xlstm")  # its mixer's projections take no adapters
    with pytest.raises(ValueError, match="LoRA adapters are not applied to xLSTM's mLSTM layers"):
        LLM(config=EngineConfig(model=str(xlstm), device="cpu", quantization="none", lora=LoraConfig()))
    with pytest.raises(ValueError, match=r"MiniMax-01, xLSTM, RWKV\)"):
        engine(xlstm, speculative_config=speculative)
    rwkv = save_family(tmp_path / "rwkv", "rwkv")
    with pytest.raises(ValueError, match="LoRA adapters are not applied to RWKV's time and channel mixes"):
        LLM(config=EngineConfig(model=str(rwkv), device="cpu", quantization="none", lora=LoraConfig()))
    falcon = save_family(tmp_path / "falcon", "falcon-h1")  # its multipliers are in the weights an adapter adds to
    with pytest.raises(ValueError, match=r"LoRA adapters are not applied to Falcon-H1 \(its multipliers"):
        LLM(config=EngineConfig(model=str(falcon), device="cpu", quantization="none", lora=LoraConfig()))
