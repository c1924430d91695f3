"""LoRA adapters on the engine's float path (`--quantization none`), against PEFT's own model on the same random
adapters (tests/lora_adapters.py): greedy output equal token for token, unmerged, for adapters on attention and on
the MLP, ranks 4 to 16, rsLoRA on and off, an alpha pattern, Phi-3's fused projections; equal to the engine's own
output with the adapter merged into the base weights; a batch mixing many adapters and the base model equal to each
request alone, also with fewer slots than adapters (requests wait for one); no prefix-cache hits across adapters;
every adapter PEFT can save that ladle does not apply refused by name, the engine serving on."""

from __future__ import annotations

import gc
import json
import random
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_server import LLM, SamplingParams
from engine_server.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
from engine_server.cuda_graphs import EagerCapture
from engine_server.errors import AdapterExistsError, AdapterNotFoundError, LoraDisabledError, ValidationError
from tests.families import VOCAB_SIZE, hf_greedy, load_reference, save_family
from tests.lora_adapters import ATTENTION, MLP, load_peft, save_adapter, save_merged

pytestmark = pytest.mark.slow  # engines and transformers' models of their own

NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
# name -> (targets, rank, save_adapter settings)
ADAPTERS: dict[str, tuple[list[str], int, dict[str, Any]]] = {
    "attention-r8": (ATTENTION, 8, {"alpha": 16, "seed": 1}),
    "mlp-r16-rslora": (MLP, 16, {"alpha": 32, "rslora": True, "seed": 2}),
    "all-r4-pattern": (ATTENTION + MLP, 4, {"alpha": 8, "seed": 3, "alpha_pattern": {"q_proj": 2, "down_proj": 24}}),
    "qv-r8": (["q_proj", "v_proj"], 8, {"alpha": 8, "seed": 4}),
}


def prompts(count: int = 4, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, VOCAB_SIZE) for _ in range(rng.choice((1, 5, 17, 40, 70)))] for _ in range(count)]


def engine(
    base: Path, max_loras: int = 4, quantization: str = "none", max_num_batched_tokens: int = 4096, **lora: Any
) -> LLM:
    config = EngineConfig(
        model=str(base), device="cpu", quantization=quantization, cache=CacheConfig(memory_bytes=64 * 1024**2),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens),
        lora=LoraConfig(max_loras=max_loras, max_lora_rank=16, **lora),
    )  # fmt: skip
    return LLM(config=config)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path], dict[str | None, list[list[int]]]]:
    """(base folder, adapter folders by name, PEFT's greedy tokens of `prompts()` by adapter name; None: base)."""
    root = tmp_path_factory.mktemp("lora")
    base = save_family(root / "base", "llama")
    folders = {
        name: save_adapter(base, root / name, targets, rank, **settings)
        for name, (targets, rank, settings) in ADAPTERS.items()
    }
    expected: dict[str | None, list[list[int]]] = {None: hf_greedy(load_reference(base), prompts(), NUM_TOKENS)}
    for name, folder in folders.items():
        expected[name] = hf_greedy(load_peft(base, folder), prompts(), NUM_TOKENS)
    return base, folders, expected


def tokens(results: list[Any]) -> list[list[int]]:
    return [result.choices[0].token_ids for result in results]


def test_adapters_equal_peft_token_for_token_in_one_mixed_batch(models: Any) -> None:
    base, folders, expected = models
    llm = engine(base)
    for name, folder in folders.items():
        llm.load_adapter(name, str(folder))
    names: list[str | None] = [None, *folders]
    batch = [prompt for _ in names for prompt in prompts()]
    adapters = [name for name in names for _ in prompts()]
    got = tokens(llm.generate(batch, GREEDY, adapters=adapters, use_tqdm=False))
    for i, name in enumerate(names):
        assert got[i * 4 : (i + 1) * 4] == expected[name], name
        if name is not None:
            assert expected[name] != expected[None], f"{name} changes nothing: the test would not see it applied"


def test_decode_graphs_apply_the_adapters(models: Any) -> None:
    """The decode graphs' padded static-buffer path (recorded with the adapters' kernels, each row's slot read from
    a static buffer; replayed eagerly on the CPU) equals PEFT too, with async scheduling's pending tokens."""
    base, folders, expected = models
    config = EngineConfig(
        model=str(base), device="cpu", quantization="none", cache=CacheConfig(memory_bytes=64 * 1024**2),
        async_scheduling=True, lora=LoraConfig(tuple((n, str(f)) for n, f in folders.items()), max_lora_rank=16),
    )  # fmt: skip
    llm = LLM(config=config)
    graphs = llm.core.runner.capture_decode_graphs(EagerCapture())
    names: list[str | None] = [None, *folders]
    batch = [prompt for _ in names for prompt in prompts()]
    got = tokens(llm.generate(batch, GREEDY, adapters=[name for name in names for _ in prompts()], use_tqdm=False))
    assert [got[i * 4 : (i + 1) * 4] for i in range(len(names))] == [expected[name] for name in names]
    assert sum(graphs.replays.values()) >= NUM_TOKENS - 2


def test_phi3_fused_projections_equal_peft(tmp_path: Path) -> None:
    """Phi-3 checkpoints fuse q/k/v and gate/up, so its adapters target `qkv_proj` and `gate_up_proj` whole."""
    base = save_family(tmp_path / "phi3", "phi3")
    folder = save_adapter(base, tmp_path / "fused", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], 8, seed=5)
    expected = hf_greedy(load_peft(base, folder), prompts(), NUM_TOKENS)
    llm = engine(base)
    llm.load_adapter("fused", str(folder))
    assert tokens(llm.generate(prompts(), GREEDY, adapters="fused", use_tqdm=False)) == expected
    assert expected != hf_greedy(load_reference(base), prompts(), NUM_TOKENS)


@pytest.mark.parametrize("family", ["gemma4", "gemma4-moe"])
def test_gemma4_adapters_equal_peft_on_every_kind_of_layer(family: str, tmp_path: Path) -> None:
    """Gemma 4's layers differ in shape (tests/families.py): sliding layers' heads 16 wide, full-attention layers'
    32 wide with one KV head and no v_proj (values are the keys' projection), the last two layers no k/v_proj (they
    read earlier layers' K/V) and MLPs twice as wide; its experts model has a dense MLP beside the experts. Adapters
    on every projection they have equal PEFT token for token, in one batch with the base model and a second
    adapter (so the sharing layers' last-token rows keep each row's adapter) and prefilled in 16-token chunks."""
    base = save_family(tmp_path / family, family, head_spread=0.5)
    folders = {
        "all-r8": save_adapter(base, tmp_path / "all", ATTENTION + MLP, 8, seed=6),
        "qv-r4": save_adapter(base, tmp_path / "qv", ["q_proj", "v_proj"], 4, seed=7),
    }
    expected: dict[str | None, list[list[int]]] = {None: hf_greedy(load_reference(base), prompts(), NUM_TOKENS)}
    for name, folder in folders.items():
        expected[name] = hf_greedy(load_peft(base, folder), prompts(), NUM_TOKENS)
    assert expected["all-r8"] != expected[None] and expected["qv-r4"] != expected[None]
    names: list[str | None] = [None, *folders]
    batch = [prompt for _ in names for prompt in prompts()]
    adapters = [name for name in names for _ in prompts()]
    for chunk in (4096, 16):
        llm = engine(base, max_num_batched_tokens=chunk)
        for name, folder in folders.items():
            llm.load_adapter(name, str(folder))
        got = tokens(llm.generate(batch, GREEDY, adapters=adapters, use_tqdm=False))
        assert [got[i * 4 : (i + 1) * 4] for i in range(len(names))] == [expected[n] for n in names], (family, chunk)
    # A projection the layer lacks (a K/V-sharing layer's k_proj; a full-attention layer's v_proj) is refused by name.
    layer, module = (4, "k_proj") if family == "gemma4" else (2, "v_proj")
    hidden = json.loads((base / "config.json").read_text())["hidden_size"]
    prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
    tensors = {f"{prefix}.lora_A.weight": torch.zeros(4, hidden), f"{prefix}.lora_B.weight": torch.zeros(16, 4)}
    settings = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": [module]}
    with pytest.raises(ValidationError, match=f"in layer {layer}, not 'self_attn.{module}'"):
        llm.load_adapter("lacking", str(_write_adapter(tmp_path / "lacking", settings, tensors)))
    llm.close()


def test_llama4_adapters_equal_peft(tmp_path: Path) -> None:
    """Llama 4 (tests/families.py): its q/k rows hold each head's rope pairs interleaved, reordered at load, and an
    adapter's q/k updates with them, on its rope and NoPE layers alike; its dense layers' MLP is `feed_forward`.
    Adapters on every attention projection and the dense layers' MLPs, and on q/k alone, equal PEFT token for token
    in one batch with the base model, past the model's 32-position attention chunks. A fused q/k/v adapter, whose
    rows would need the same reordering per part, is refused by name."""
    base = save_family(tmp_path / "llama4", "llama4")
    attention_and_dense = r".*\.(q|k|v|o)_proj|.*layers\.[02]\.feed_forward\.(gate|up|down)_proj"  # layers 1, 3: MoE
    folders = {
        "all-r8": save_adapter(base, tmp_path / "all", attention_and_dense, 8, seed=8),
        "qk-r4": save_adapter(base, tmp_path / "qk", ["q_proj", "k_proj"], 4, seed=9),
    }
    # Each prompt alone: transformers' NoPE temperature counts a batch's left padding among the positions.
    models = {None: load_reference(base), **{name: load_peft(base, folder) for name, folder in folders.items()}}
    expected = {name: [hf_greedy(model, [p], NUM_TOKENS)[0] for p in prompts()] for name, model in models.items()}
    assert expected["all-r8"] != expected[None] and expected["qk-r4"] != expected[None]
    names: list[str | None] = [None, *folders]
    llm = engine(base)
    for name, folder in folders.items():
        llm.load_adapter(name, str(folder))
    batch = [prompt for _ in names for prompt in prompts()]
    got = tokens(llm.generate(batch, GREEDY, adapters=[name for name in names for _ in prompts()], use_tqdm=False))
    assert [got[i * 4 : (i + 1) * 4] for i in range(len(names))] == [expected[n] for n in names]
    config = json.loads((base / "config.json").read_text())
    rows = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * config["head_dim"]
    prefix = "base_model.model.model.layers.0.self_attn.qkv_proj"
    tensors = {f"{prefix}.lora_A.weight": torch.zeros(4, config["hidden_size"]),
               f"{prefix}.lora_B.weight": torch.zeros(rows, 4)}  # fmt: skip
    settings = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["qkv_proj"]}
    with pytest.raises(ValidationError, match="a fused q/k/v adapter on llama4"):
        llm.load_adapter("fused", str(_write_adapter(tmp_path / "fused", settings, tensors)))
    llm.close()


def test_glm4_qk_adapters_equal_peft(tmp_path: Path) -> None:
    """GLM-4 (tests/families.py): the first half of each head's q/k rows holds rope pairs interleaved, reordered at
    load, and an adapter's q/k updates with them (the rest of each head's rows where they are). An adapter on q and
    k equals PEFT token for token in one batch with the base model."""
    base = save_family(tmp_path / "glm4", "glm4")
    folder = save_adapter(base, tmp_path / "qk", ["q_proj", "k_proj"], 4, seed=9)
    expected = {name: hf_greedy(model, prompts(), NUM_TOKENS)
                for name, model in ((None, load_reference(base)), ("qk-r4", load_peft(base, folder)))}  # fmt: skip
    assert expected["qk-r4"] != expected[None]
    with engine(base) as llm:
        llm.load_adapter("qk-r4", str(folder))
        batch = prompts() * 2
        got = tokens(llm.generate(batch, GREEDY, adapters=[None] * 4 + ["qk-r4"] * 4, use_tqdm=False))
    assert [got[:4], got[4:]] == [expected[None], expected["qk-r4"]]


# Families whose adapters land in rows laid out their own way: NanoChat's q/k rows read with their halves swapped (its
# rope turns the other way: an adapter's q/k updates likewise), its MLP's `fc1` / `fc2` the ungated MLP's up and down;
# Laguna's layers of 4, 8, 4 and 2 query heads (q_proj's and o_proj's widths each layer's own).
OWN_ROWS_ADAPTERS = {"nanochat": ["q_proj", "k_proj", "fc1", "fc2"], "laguna": ATTENTION}


@pytest.mark.parametrize("family", sorted(OWN_ROWS_ADAPTERS))
def test_adapters_on_rows_laid_out_their_own_way_equal_peft(family: str, tmp_path: Path) -> None:
    """An adapter on `OWN_ROWS_ADAPTERS`' modules (tests/families.py's models) equals PEFT token for token in one batch
    with the base model, which equals transformers."""
    base = save_family(tmp_path / family, family)
    folder = save_adapter(base, tmp_path / "adapter", OWN_ROWS_ADAPTERS[family], 8, seed=5)
    expected = {name: hf_greedy(model, prompts(), NUM_TOKENS)
                for name, model in ((None, load_reference(base)), ("adapter", load_peft(base, folder)))}  # fmt: skip
    assert expected["adapter"] != expected[None]
    with engine(base) as llm:
        llm.load_adapter("adapter", str(folder))
        got = tokens(llm.generate(prompts() * 2, GREEDY, adapters=[None] * 4 + ["adapter"] * 4, use_tqdm=False))
    assert [got[:4], got[4:]] == [expected[None], expected["adapter"]]


# The classic families' adapters under their checkpoints' own module names (`lora.peft_format`'s renames): GPT-NeoX's
# and Falcon 40B's `query_key_value` (grouped by KV head: a head a group in GPT-NeoX's; the update's rows reordered as
# the base's), `dense`, `dense_h_to_4h` and `dense_4h_to_h`; GPT-BigCode's `c_attn`, `c_proj` and `c_fc` (StarCoder2's
# MLP names too); GPT-J's `out_proj`, `fc_in`, `fc_out` and its q/k (rows reordered as the base's: its rope pairs
# interleaved); Phi's `dense`, `fc1` and `fc2` (an ungated MLP: `up_proj` the one segment of `gate_up_proj`); EXAONE
# 3's `attn.attention.*` and `c_fc_0` / `c_fc_1` / `c_proj` under `transformer.h.<n>`.
CLASSIC_ADAPTERS = {
    "gpt-neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "falcon-40b": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "gpt-bigcode": ["c_attn", "c_proj", "c_fc"],
    "gptj": ["q_proj", "k_proj", "out_proj", "fc_in", "fc_out"],
    "phi": ["q_proj", "v_proj", "dense", "fc1", "fc2"],
    "exaone": ["q_proj", "out_proj", "c_fc_0", "c_fc_1", "c_proj"],
}


@pytest.mark.parametrize("family", sorted(CLASSIC_ADAPTERS))
def test_classic_family_adapters_equal_peft_under_their_own_names(family: str, tmp_path: Path) -> None:
    base = save_family(tmp_path / family, family)
    folder = save_adapter(base, tmp_path / "adapter", CLASSIC_ADAPTERS[family], 8, seed=11)
    expected = hf_greedy(load_peft(base, folder), prompts(), NUM_TOKENS)
    assert expected != hf_greedy(load_reference(base), prompts(), NUM_TOKENS)
    with engine(base) as llm:
        llm.load_adapter("classic", str(folder))
        assert tokens(llm.generate(prompts(), GREEDY, adapters="classic", use_tqdm=False)) == expected


def test_adapters_on_an_ungated_mlp_equal_peft(tmp_path: Path) -> None:
    """Arcee's MLP is ungated, `down(relu(up(x))²)`: an adapter on its `up_proj` and `down_proj` lands in the one
    segment of `gate_up_proj` and in `down_proj` (until stop 93 it was accepted and not applied)."""
    base = save_family(tmp_path / "arcee", "arcee")
    folder = save_adapter(base, tmp_path / "mlp", ["up_proj", "down_proj"], 8, seed=3)
    expected = hf_greedy(load_peft(base, folder), prompts(), NUM_TOKENS)
    assert expected != hf_greedy(load_reference(base), prompts(), NUM_TOKENS)
    with engine(base) as llm:
        llm.load_adapter("mlp", str(folder))
        assert tokens(llm.generate(prompts(), GREEDY, adapters="mlp", use_tqdm=False)) == expected


def test_adapter_equals_its_weights_merged_into_the_base(models: Any, tmp_path: Path) -> None:
    base, folders, _ = models
    for name in ("attention-r8", "mlp-r16-rslora"):
        merged = save_merged(base, folders[name], tmp_path / f"merged-{name}")
        with_adapter = engine(base, modules=((name, str(folders[name])),))
        plain = LLM(config=EngineConfig(model=str(merged), device="cpu", quantization="none",
                                        cache=CacheConfig(memory_bytes=64 * 1024**2)))  # fmt: skip
        assert tokens(with_adapter.generate(prompts(), GREEDY, adapters=name, use_tqdm=False)) == tokens(
            plain.generate(prompts(), GREEDY, use_tqdm=False)
        ), name


@pytest.mark.parametrize(("max_loras", "quantization"), [(4, "none"), (2, "none"), (4, "int8")])
def test_a_batch_of_32_over_4_adapters_and_the_base_equals_each_request_alone(
    models: Any, max_loras: int, quantization: str
) -> None:
    """32 requests in one step (then decoding together) equal each run alone; with 2 slots for 4 adapters the
    requests of the others wait for a slot and still equal. On int8 weights (batch-invariant kernels) the outputs
    are compared bit for bit through their log-probabilities too."""
    base, folders, _ = models
    llm = engine(base, max_loras=max_loras, quantization=quantization)
    for name, folder in folders.items():
        llm.load_adapter(name, str(folder))
    names: list[str | None] = [None, *folders]
    batch = prompts(32, seed=11)
    adapters = [names[i % len(names)] for i in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=True)
    together = llm.generate(batch, params, adapters=adapters, use_tqdm=False)
    alone = [llm.generate([p], params, adapters=a, use_tqdm=False)[0] for p, a in zip(batch, adapters, strict=True)]
    assert tokens(together) == tokens(alone)
    if quantization == "int8":
        assert [c.choices[0].logprobs for c in together] == [c.choices[0].logprobs for c in alone]


def test_no_prefix_cache_hits_across_adapters(models: Any) -> None:
    base, folders, _ = models
    llm = engine(base, modules=(("a", str(folders["attention-r8"])), ("b", str(folders["qv-r8"]))))
    prompt = [random.Random(3).randrange(10, VOCAB_SIZE) for _ in range(48)]  # three whole blocks
    cached = []
    for adapter in ("a", None, "b", "a", None):
        cached.append(llm.generate([prompt], GREEDY, adapters=adapter, use_tqdm=False)[0].usage.cached_prompt_tokens)
    assert cached[:3] == [0, 0, 0]  # each namespace's first request computes its prompt
    assert cached[3] > 0 and cached[4] > 0  # and later ones of the same adapter (or of none) hit


def _write_adapter(folder: Path, config: dict[str, Any], tensors: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_adapters_ladle_does_not_apply_are_refused_by_name(models: Any, tmp_path: Path) -> None:
    base, folders, _ = models
    llm = engine(base)
    good = folders["qv-r8"]
    settings = json.loads((good / "adapter_config.json").read_text())
    from safetensors.torch import load_file

    weights = load_file(str(good / "adapter_model.safetensors"))
    head = {**weights, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}
    narrow = {k: torch.zeros(v.shape[0], 32) if "lora_A" in k else v for k, v in weights.items()}
    half = {k: v for k, v in weights.items() if "lora_B" not in k}
    cases = {
        "no-folder": (tmp_path / "missing", "is not a folder"),
        "dora": (_write_adapter(tmp_path / "dora", {**settings, "use_dora": True}, weights), "DoRA"),
        "saved": (_write_adapter(tmp_path / "saved", {**settings, "modules_to_save": ["lm_head"]}, weights),
                  "modules_to_save"),
        "bias": (_write_adapter(tmp_path / "bias", {**settings, "bias": "all"}, weights), "biases"),
        "head": (_write_adapter(tmp_path / "head", settings, head), "not a LoRA A/B weight"),
        "other-model": (_write_adapter(tmp_path / "other", settings, narrow), "another model"),
        "half-pair": (_write_adapter(tmp_path / "half", settings, half), "in pairs"),
    }  # fmt: skip
    for name, (folder, message) in cases.items():
        with pytest.raises(ValidationError, match=message) as caught:
            llm.load_adapter(name, str(folder))
        assert caught.value.param == "lora_path"
    ranked = save_adapter(base, tmp_path / "rank32", ["q_proj"], 32, seed=9)
    with pytest.raises(ValidationError, match="above the engine's --max-lora-rank 16"):
        llm.load_adapter("rank32", str(ranked))
    llm.load_adapter("qv", str(good))
    with pytest.raises(AdapterExistsError):
        llm.load_adapter("qv", str(good))
    with pytest.raises(ValidationError, match="base model's id"):
        llm.load_adapter(llm.model_name, str(good))
    with pytest.raises(AdapterNotFoundError):
        llm.generate(prompts(1), GREEDY, adapters="nope", use_tqdm=False)
    with pytest.raises(AdapterNotFoundError):
        llm.unload_adapter("nope")
    # Nothing above disturbed it.
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == models[2][None]
    assert tokens(llm.generate(prompts(), GREEDY, adapters="qv", use_tqdm=False)) == models[2]["qv-r8"]


def test_unloading_frees_the_adapter(models: Any) -> None:
    """After unload the registry keeps none of its bytes and, once no request holds it (the runner keeps the last
    step's requests until the next step), nothing does."""
    base, folders, expected = models
    llm = engine(base)
    assert llm.adapters is not None
    llm.load_adapter("qv", str(folders["qv-r8"]))
    held = weakref.ref(llm.adapters.resolve("qv"))
    assert llm.adapters.host_bytes > 0
    assert tokens(llm.generate(prompts(), GREEDY, adapters="qv", use_tqdm=False)) == expected["qv-r8"]
    llm.unload_adapter("qv")
    assert llm.adapters.host_bytes == 0
    llm.generate(prompts(1), GREEDY, use_tqdm=False)  # the runner keeps its last step's requests until the next
    gc.collect()
    assert held() is None
    with pytest.raises(AdapterNotFoundError):
        llm.generate(prompts(1), GREEDY, adapters="qv", use_tqdm=False)


def test_an_engine_without_lora_refuses_adapters(models: Any) -> None:
    base, folders, _ = models
    llm = LLM(config=EngineConfig(model=str(base), device="cpu", quantization="none",
                                  cache=CacheConfig(memory_bytes=64 * 1024**2)))  # fmt: skip
    with pytest.raises(LoraDisabledError):
        llm.load_adapter("qv", str(folders["qv-r8"]))
