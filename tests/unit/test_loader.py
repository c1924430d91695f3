"""Model loading: GGUF conversion against transformers' own GGUF loader, caching, HF folders, dummy presets."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGUFReader, GGUFWriter, PoolingType

from engine_server.attention_metadata import kv_cache_bytes_per_block
from engine_server.config import ModelConfig, RopeScaling
from engine_server.loader import (
    DUMMY_PRESETS,
    ModelSource,
    default_gguf_path,
    gguf_convert,
    resolve_model,
    write_float_checkpoint,
)
from engine_server.loader.dummy import (
    GEMMA3N_HF_CONFIGS,
    GEMMA4_HF_CONFIGS,
    INIT_STD,
    STATE_SPACE_HF_CONFIGS,
    random_tensor,
)
from engine_server.loader.gguf_metadata import GgufFile, llama3_rope_factors, transformers_metadata
from engine_server.loader.layout import parameter_shapes
from engine_server.loader.lazy_tensor import LazyTensor
from engine_server.tokenizer.loading import load_tokenizer

pytestmark = pytest.mark.slow  # reads and converts the embedded model's GGUF


@pytest.fixture(scope="module")
def cache_dir(ladle_cache_dir: Path) -> Path:
    """The run's model cache, where the other tests' engines find the embedded model already converted."""
    return ladle_cache_dir


@pytest.fixture(scope="module")
def default_source(cache_dir: Path) -> ModelSource:
    return resolve_model("default", cache_dir=cache_dir)


@pytest.fixture(scope="module")
def gguf_reference() -> Iterator[torch.nn.Module]:
    """transformers' own GGUF loader on the embedded file: dequantized, q/k un-permuted, fp32."""
    path = default_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    )
    yield model.eval()


def hf_config(cfg: ModelConfig) -> transformers.PretrainedConfig:
    """The transformers config of `cfg`'s shape, to check our parameter layout against transformers'. A Gemma 4 or
    Gemma 3n preset's, or a state space model's, is the config it was parsed from (`loader.dummy.GEMMA4_HF_CONFIGS`,
    `GEMMA3N_HF_CONFIGS`, `STATE_SPACE_HF_CONFIGS`)."""
    if cfg.gemma4 is not None or cfg.architecture == "mamba":
        presets = STATE_SPACE_HF_CONFIGS if cfg.gemma4 is None else GEMMA3N_HF_CONFIGS if cfg.altup else \
            GEMMA4_HF_CONFIGS  # fmt: skip
        arguments = dict(presets[cfg.name.removeprefix("dummy:")])
        return transformers.AutoConfig.for_model(str(arguments.pop("model_type")), **arguments)
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias")  # fmt: skip
    experts = {}
    if cfg.num_experts:
        experts = dict(
            num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size, mlp_only_layers=list(cfg.dense_layers),
        )  # fmt: skip
    shape = {f: getattr(cfg, f) for f in fields}
    if cfg.layer_windows:
        shape["layer_types"] = ["sliding_attention" if w else "full_attention" for w in cfg.layer_windows]
    model_type = {"gemma3": "gemma3_text"}.get(cfg.architecture, cfg.architecture)  # Gemma 3's text model
    mla = cfg.latent_attention
    if mla is not None:  # DeepSeek-V3: its latent attention's shape, its experts' names
        shape.pop("head_dim")
        experts = dict(
            n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size, first_k_dense_replace=len(cfg.dense_layers),
            n_shared_experts=cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size,
            n_group=cfg.moe_groups, topk_group=cfg.moe_topk_groups, q_lora_rank=mla.q_lora_rank or None,
            kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
            qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
        )  # fmt: skip
    linear = cfg.linear_attention
    if linear is not None and linear.kimi_delta:  # Kimi Linear: latent attention beside Kimi Delta Attention
        assert mla is not None
        return transformers.KimiLinearConfig(
            **{k: v for k, v in shape.items() if k != "head_dim"},
            layer_types=["linear_attention" if cfg.is_linear_layer(i) else "full_attention"
                         for i in range(cfg.num_hidden_layers)],
            mlp_layer_types=["dense" if i in cfg.dense_layers else "sparse" for i in range(cfg.num_hidden_layers)],
            num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            n_shared_experts=cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size,
            n_group=cfg.moe_groups, topk_group=cfg.moe_topk_groups, q_lora_rank=mla.q_lora_rank or None,
            kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
            qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim, linear_num_heads=linear.num_value_heads,
            linear_head_dim=linear.key_head_dim, linear_conv_kernel_dim=linear.conv_kernel,
        )  # fmt: skip
    if linear is not None:  # Qwen3.5: its linear-attention layers' shape, its text model (dense or experts)
        model_type = "qwen3_5_moe_text" if cfg.num_experts else "qwen3_5_text"
        shape["layer_types"] = [
            "linear_attention" if cfg.is_linear_layer(i) else "full_attention" for i in range(cfg.num_hidden_layers)
        ]
        shape.update(
            linear_num_key_heads=linear.num_key_heads, linear_num_value_heads=linear.num_value_heads,
            linear_key_head_dim=linear.key_head_dim, linear_value_head_dim=linear.value_head_dim,
            linear_conv_kernel_dim=linear.conv_kernel,
        )  # fmt: skip
        if cfg.num_experts:
            experts.pop("mlp_only_layers")
            experts["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    return transformers.AutoConfig.for_model(model_type, **shape, **experts)


def state_shapes(model: torch.nn.Module, tied: bool) -> dict[str, tuple[int, ...]]:
    """The model's parameter shapes as a checkpoint stores them: transformers 5 holds a mixture of experts' experts
    as 3-D tensors, which it saves one per expert and projection (`experts.<e>.gate_proj.weight`), but gpt-oss's
    as they are (its checkpoints' own banks). Kimi Linear's decay parameters as the engine names them: on the layer,
    not a `forget_gate` of it, `A_log` a value per head."""
    shapes: dict[str, tuple[int, ...]] = {}
    banked = type(model).__name__.startswith("GptOss")
    for name, tensor in model.state_dict().items():
        name = name.replace(".forget_gate.", ".")
        if name.endswith("self_attn.A_log"):
            tensor = tensor.reshape(-1)
        bank, _, projection = name.rpartition(".")
        if bank.endswith(".experts") and projection in ("gate_up_proj", "down_proj") and not banked:
            experts, rows, columns = tensor.shape
            for e in range(experts):
                if projection == "down_proj":
                    shapes[f"{bank}.{e}.down_proj.weight"] = (rows, columns)
                else:
                    shapes[f"{bank}.{e}.gate_proj.weight"] = shapes[f"{bank}.{e}.up_proj.weight"] = (rows // 2, columns)
        else:
            shapes[name] = tuple(tensor.shape)
    if tied:
        shapes.pop("lm_head.weight", None)
    return shapes


# --- the embedded GGUF -------------------------------------------------------------------------------------


def test_default_config_from_gguf_metadata(default_source: ModelSource, cache_dir: Path) -> None:
    cfg = default_source.config
    assert (cfg.architecture, cfg.hidden_size, cfg.intermediate_size) == ("llama", 576, 1536)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        30, 9, 3, 64
    )  # fmt: skip
    assert (cfg.vocab_size, cfg.rope_theta, cfg.rms_norm_eps) == (49152, 100000.0, 1e-5)
    assert (cfg.max_position_embeddings, cfg.tie_word_embeddings) == (8192, True)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    assert default_source.name == cfg.name == "SmolLM2-135M-Instruct"
    assert default_source.path.parent == cache_dir / "gguf"
    assert default_source.tokenizer_path == default_source.path
    assert not default_source.random_weights


def test_dequantized_weights_equal_transformers_gguf_loader(
    default_source: ModelSource, gguf_reference: torch.nn.Module
) -> None:
    reference = gguf_reference.state_dict()
    ours = dict(default_source.weights())
    assert set(ours) == set(default_source.weight_shapes())
    assert set(reference) - set(ours) == {"lm_head.weight"}  # tied: transformers materialises the alias
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == reference[name].shape, name
        assert (tensor - reference[name]).abs().max().item() <= 1e-6, name


def test_converted_folder_runs_in_transformers_like_the_gguf(
    default_source: ModelSource, gguf_reference: torch.nn.Module, tmp_path: Path
) -> None:
    """config.json is right: transformers on our folder (with the weights written out) gives the GGUF model's
    logits."""
    folder = write_float_checkpoint(default_source, tmp_path / "float")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, local_files_only=True
    ).eval()
    ids = torch.tensor([[1, 19556, 905, 30, 2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, gguf_reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_the_cache_entry_holds_no_weights_which_are_read_from_the_file(
    default_source: ModelSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The converted folder is the file's metadata alone (a float copy was 517 MB beside this 90 MB file): the
    weights are read from the GGUF file, lazily as eagerly, and a lazy tensor left unread dequantizes nothing."""
    files = [path for path in default_source.path.rglob("*") if path.is_file()]
    assert not [path for path in files if ".safetensors" in path.name], files
    assert sum(path.stat().st_size for path in files) < 16 * 1024**2
    eager = dict(default_source.weights())
    calls: list[str] = []
    real = gguf_convert._dequantized
    monkeypatch.setattr(gguf_convert, "_dequantized", lambda tensor, *a: calls.append(tensor.name) or real(tensor, *a))
    lazy = dict(default_source.lazy_weights())
    assert calls == [] and set(lazy) == set(eager)
    for name, tensor in lazy.items():
        assert isinstance(tensor, LazyTensor) and tensor.shape == eager[name].shape, name
        assert torch.equal(tensor.materialize(), eager[name]), name
    assert len(calls) == len(eager)


def test_tokenizer_and_chat_template_from_gguf(default_source: ModelSource) -> None:
    tokenizer = load_tokenizer(default_source.tokenizer_path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.model_max_length == 8192
    ids = tokenizer.encode("Hello world")
    assert ids == [19556, 905] and tokenizer.decode(ids) == "Hello world"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(prompt, str)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    replaced = load_tokenizer(default_source.tokenizer_path, "{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert replaced.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"  # vLLM's flag
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_second_resolve_reuses_cached_folder(
    default_source: ModelSource, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "convert_gguf", no_conversion)
    again = resolve_model("default", cache_dir=cache_dir)
    assert again == default_source
    by_path = resolve_model(str(default_gguf_path()), cache_dir=cache_dir)
    assert by_path.path == default_source.path and by_path.name == "SmolLM2-135M-Instruct.Q4_1"


def test_failed_conversion_leaves_no_cache_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash_midway(gguf_path: Path, folder: Path, spec: str) -> None:
        (folder / "model.safetensors").write_bytes(b"half a file")
        raise RuntimeError("killed")

    monkeypatch.setattr(gguf_convert, "convert_gguf", crash_midway)
    with pytest.raises(RuntimeError, match="killed"):
        resolve_model("default", cache_dir=tmp_path)
    assert list((tmp_path / "gguf").iterdir()) == []


# --- Hugging Face folders -----------------------------------------------------------------------------------


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_hf_folder_round_trip(architecture: str, default_source: ModelSource, tmp_path: Path) -> None:
    tiny = ModelConfig(
        architecture=architecture,  # type: ignore[arg-type]
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=256, tie_word_embeddings=False, attention_bias=architecture == "qwen2",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(tiny))
    model.save_pretrained(str(tmp_path))
    load_tokenizer(default_source.tokenizer_path).save_pretrained(str(tmp_path))

    source = resolve_model(str(tmp_path))
    assert source.path == tmp_path.resolve() and source.name == tmp_path.name
    assert source.config.architecture == architecture
    assert source.config.attention_bias == (architecture == "qwen2")
    assert source.config.qk_norm == (architecture == "qwen3")
    weights = dict(source.weights())
    reference = model.state_dict()
    assert set(weights) == set(reference) == set(source.weight_shapes())
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name
        assert tuple(tensor.shape) == source.weight_shapes()[name]
    assert load_tokenizer(source.tokenizer_path).encode("Hello world") == [19556, 905]


# --- dummy presets ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(DUMMY_PRESETS))
def test_dummy_preset_layout_matches_transformers(
    preset: str, default_source: ModelSource, cache_dir: Path
) -> None:
    source = resolve_model(f"dummy:{preset}", cache_dir=cache_dir)
    assert source.random_weights and source.name == f"dummy:{preset}"
    assert source.tokenizer_path == default_source.path
    cfg = source.config
    with torch.device("meta"):  # full-size shapes without allocating the weights
        model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg))
    assert source.weight_shapes() == state_shapes(model, tied=cfg.tie_word_embeddings)


def test_dummy_weights_stream_with_declared_shapes(cache_dir: Path) -> None:
    source = resolve_model("dummy:smollm2-135m", cache_dir=cache_dir)
    shapes = source.weight_shapes()
    seen = []
    for name, tensor in source.weights():
        assert tuple(tensor.shape) == shapes[name] and tensor.dtype == torch.float32, name
        seen.append(name)
    assert seen == list(shapes)


def test_dummy_preset_configs() -> None:
    qwen25 = DUMMY_PRESETS["qwen2.5-0.5b"]
    assert (qwen25.hidden_size, qwen25.vocab_size, qwen25.attention_bias) == (896, 151936, True)
    tiny = DUMMY_PRESETS["qwen2-tiny"]  # the tokenizer's whole vocabulary; 2 KV heads for TP=2
    assert (tiny.vocab_size, tiny.num_key_value_heads, tiny.attention_bias) == (49152, 2, True)
    llama = DUMMY_PRESETS["llama-3.2-1b"]
    assert llama.rope_scaling is not None and llama.rope_scaling.factor == 32.0
    qwen3 = DUMMY_PRESETS["qwen3-0.6b"]
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.max_position_embeddings) == (128, True, 40960)
    llama8b = DUMMY_PRESETS["llama-3.1-8b"]
    params = sum(math.prod(shape) for shape in parameter_shapes(llama8b).values())
    assert params == 8_030_261_248  # Llama 3.1 8B's published count
    moe = DUMMY_PRESETS["qwen3-30b-a3b"]
    params = sum(math.prod(shape) for shape in parameter_shapes(moe).values())
    assert params == 30_532_122_624  # Qwen3-30B-A3B's


    moonlight = DUMMY_PRESETS["moonlight-16b-a3b"]  # its layout too
    params = sum(math.prod(shape) for shape in parameter_shapes(moonlight).values())
    assert params == 15_960_110_208  # Moonlight-16B-A3B's
    assert (moonlight.head_dim, moonlight.num_key_value_heads, moonlight.rotary_dim) == (576, 1, 64)
    # Its cache: one latent row per token and layer (512 + 64 rope dims), 5.3x less than 16 heads' keys and values
    assert kv_cache_bytes_per_block(moonlight, 16, torch.bfloat16) == 27 * 16 * 2 * 576 * 2
    kimi = DUMMY_PRESETS["kimi-linear-48b-a3b"]  # its layout too: Kimi Delta Attention beside latent attention
    shapes = parameter_shapes(kimi)
    params = sum(math.prod(shape) for shape in shapes.values())
    experts = sum(math.prod(shape) for name, shape in shapes.items() if ".experts." in name)
    # The model card's "48B" total and "A3B" active, rounded: 49.1B, and 2.7B active without the embeddings and head.
    assert params == 49_122_681_728 and round((params - experts * (1 - 8 / 256)) / 1e9, 1) == 3.5
    assert kimi.linear_attention is not None and len(kimi.linear_attention.layers) == 20
    assert kv_cache_bytes_per_block(kimi, 16, torch.bfloat16) == 7 * 16 * 2 * 576 * 2  # the 7 latent layers alone
    gpt_oss = DUMMY_PRESETS["gpt-oss-20b"]  # its layout too
    params = sum(math.prod(shape) for shape in parameter_shapes(gpt_oss).values())
    assert params == 20_914_757_184  # gpt-oss-20b's (the model card's "21B")
    assert [gpt_oss.attention_window(i) for i in range(4)] == [128, 0, 128, 0] and gpt_oss.attention_sinks
    assert (gpt_oss.max_position_embeddings, gpt_oss.num_experts, gpt_oss.expert_biases) == (131072, 32, True)
    gemma = DUMMY_PRESETS["gemma-3-4b"]  # its layout is held to transformers' by the test above
    params = sum(math.prod(shape) for shape in parameter_shapes(gemma).values())
    assert params == 3_880_263_168  # Gemma 3 4B's language model (the published 4B counts its vision tower too)
    assert [gemma.attention_window(i) for i in range(12)] == [1024] * 5 + [0] + [1024] * 5 + [0]
    assert (gemma.rope_linear_factor, gemma.local_rope_theta, gemma.attention_scale) == (8.0, 1e4, 1 / 16)


def test_dummy_weights_are_seeded_and_initialised(cache_dir: Path) -> None:
    source = resolve_model("dummy:smollm2-135m", cache_dir=cache_dir, seed=7)
    first = dict(itertools.islice(source.weights(), 4))
    again = dict(itertools.islice(source.weights(), 4))
    assert all(torch.equal(first[n], again[n]) for n in first)
    q = random_tensor("model.layers.0.self_attn.q_proj.weight", (576, 576), seed=7)
    assert torch.equal(q, random_tensor("model.layers.0.self_attn.q_proj.weight", (576, 576), seed=7))
    assert not torch.equal(q, random_tensor("model.layers.0.self_attn.q_proj.weight", (576, 576), seed=8))
    assert not torch.equal(q, random_tensor("model.layers.0.self_attn.k_proj.weight", (576, 576), seed=7))
    assert abs(q.std().item() - INIT_STD) < 0.1 * INIT_STD and abs(q.mean().item()) < 1e-3
    assert torch.equal(first["model.layers.0.input_layernorm.weight"], torch.ones(576))


# --- synthetic GGUF files: the other architectures and llama3 rope ---------------------------------------------

_TO_GGUF = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
_LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def gguf_name(hf_name: str) -> str:
    stem, param = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        layer, kind = stem.removeprefix("model.layers.").split(".", 1)
        return f"blk.{layer}.{_LAYER_TO_GGUF[kind]}.{param}"
    return f"{_TO_GGUF[stem.removeprefix('model.')]}.{param}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows (the inverse of what the loader must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    tokenizer_dir: Path,
    pooling_type: PoolingType | None = None,
) -> None:
    """A llama.cpp-style GGUF of a tiny model, with a 512-token slice of the SmolLM2 BPE vocabulary (and, for an
    embedding model, llama.cpp's `pooling_type`)."""
    arch = cfg.architecture
    writer = GGUFWriter(str(path), arch)
    if pooling_type is not None:
        writer.add_pooling_type(pooling_type)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)[: cfg.vocab_size]
    kept = set(tokens)
    merges = [" ".join(m) for m in vocab["merges"] if set(m) <= kept and "".join(m) in kept]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if i < 17 else 1 for i in range(len(tokens))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in state.items():
        array = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        factors = llama3_rope_factors(
            cfg.rope_theta, cfg.head_dim, rs.factor, rs.low_freq_factor, rs.high_freq_factor,
            rs.original_max_position_embeddings,
        )  # fmt: skip
        writer.add_tensor("rope_freqs.weight", factors.astype(np.float32))
        writer.add_rope_scaling_orig_ctx_len(rs.original_max_position_embeddings)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_synthetic_gguf_round_trip(
    architecture: str, default_source: ModelSource, tmp_path: Path, cache_dir: Path
) -> None:
    """Names, q/k (un)permutation, biases, q/k norms, config and llama3 rope survive GGUF → HF folder."""
    scaling = RopeScaling(8.0, 1.0, 4.0, 64) if architecture == "llama" else None
    tiny = ModelConfig(
        architecture=architecture,  # type: ignore[arg-type]
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=50000.0,
        max_position_embeddings=1024, tie_word_embeddings=architecture != "qwen2",
        attention_bias=architecture == "qwen2", qk_norm=architecture == "qwen3", rope_scaling=scaling,
    )  # fmt: skip
    state = {
        name: random_tensor(name, shape, seed=3) + (0.5 if name.endswith("norm.weight") else 0.0)
        for name, shape in parameter_shapes(tiny).items()
    }
    path = tmp_path / f"tiny-{architecture}.gguf"
    write_tiny_gguf(path, tiny, state, default_source.tokenizer_path)

    source = resolve_model(str(path), cache_dir=cache_dir)
    expected = dataclasses.replace(tiny, bos_token_id=1, eos_token_ids=(2,), name=f"tiny-{architecture}")
    assert source.config == expected
    weights = dict(source.weights())
    assert set(weights) == set(state)
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name]), name
    tokenizer = load_tokenizer(source.tokenizer_path)
    assert tokenizer.decode(tokenizer.encode("the cat")) == "the cat"


def test_a_conversion_drops_the_float_copies_of_earlier_converters(
    default_source: ModelSource, tmp_path: Path
) -> None:
    """Converters before version 7 wrote each file's weights again as fp32 beside its metadata (517 MB for the
    embedded model): a new conversion removes those entries, and leaves this version's and a conversion in
    progress."""
    tiny = dataclasses.replace(
        DUMMY_PRESETS["smollm2-135m"], vocab_size=512, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny, {n: torch.ones(s) for n, s in parameter_shapes(tiny).items()}, default_source.path)
    cache = tmp_path / "cache"
    entries = cache / "gguf"
    old, staging, current = entries / "old-0123456789abcdef", entries / ".staging.x", entries / "current-0123"
    for folder in (old, staging, current):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    (old / "model.safetensors").write_bytes(b"float copy")
    (staging / "model.safetensors").write_bytes(b"half a float copy")
    source = resolve_model(str(path), cache_dir=cache)
    assert sorted(p.name for p in entries.iterdir()) == sorted([staging.name, current.name, source.path.name])


def test_unsupported_tensor_type_is_refused(default_source: ModelSource, tmp_path: Path, cache_dir: Path) -> None:
    tiny = dataclasses.replace(
        DUMMY_PRESETS["smollm2-135m"], vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    # gguf can store F64 but cannot dequantize it: a stand-in for any type the loader does not support.
    state = {n: torch.zeros(s, dtype=torch.float64 if "embed" in n else torch.float32)
             for n, s in parameter_shapes(tiny).items()}  # fmt: skip
    path = tmp_path / "f64.gguf"
    write_tiny_gguf(path, tiny, state, default_source.tokenizer_path)
    with pytest.raises(ValueError, match="unsupported quantization F64") as info:
        resolve_model(str(path), cache_dir=cache_dir)
    assert repr(str(path)) in str(info.value)
    assert not any(p.name.startswith("f64") for p in (cache_dir / "gguf").iterdir())


# --- bad specs ----------------------------------------------------------------------------------------------


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_bad_specs_raise_value_error_naming_the_spec(tmp_path: Path, cache_dir: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hi")
    write_gguf(tmp_path / "rwkv.gguf", "rwkv6", {"token_embd.weight": np.zeros((8, 4), np.float32)})
    write_gguf(tmp_path / "bare.gguf", "llama", {"token_embd.weight": np.zeros((8, 4), np.float32)})
    cases = {
        "dummy:gpt-9": "unknown dummy preset",
        str(tmp_path / "missing.gguf"): "GGUF file not found",
        str(tmp_path / "nowhere"): "no such file or folder",
        str(tmp_path / "notes.txt"): "not a folder or a .gguf file",
        str(tmp_path / "empty"): "lacks config.json",
        str(tmp_path / "rwkv.gguf"): "unsupported GGUF architecture 'rwkv6'",
    }
    for spec, message in cases.items():
        with pytest.raises(ValueError, match=message) as info:
            resolve_model(spec, cache_dir=cache_dir)
        assert repr(spec) in str(info.value)
    with pytest.raises(ValueError, match=r"GGUF metadata lacks llama\.embedding_length"):
        resolve_model(str(tmp_path / "bare.gguf"), cache_dir=cache_dir)


def assert_fields_equal(ours: GGUFReader, theirs: GGUFReader) -> None:
    """Every field of `ours` as `theirs` has it: offset, value, types, and the parts (values and widths) and the
    indices into them that `contents()` reads."""
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), key
        assert len(mine.parts) == len(field.parts), key
        for part, their_part in zip(mine.parts, field.parts, strict=True):
            assert part.dtype.itemsize == their_part.dtype.itemsize and np.array_equal(part, their_part), key
        assert mine.contents() == field.contents(), key


def emptied(path: Path, key: str) -> None:
    """The one-item array of a 4-byte number at metadata `key` in the file at `path` made empty, as older writers
    wrote one (gguf's writer writes none): its count set to 0, its item cut."""
    raw = bytearray(path.read_bytes())
    count = raw.index(key.encode()) + len(key) + 8  # past the value type and the item type
    raw[count : count + 12] = bytes(8)  # the count 0, and no item
    path.write_bytes(bytes(raw))


def test_gguf_file_reads_arrays_of_every_kind_as_ggufs_reader(tmp_path: Path) -> None:
    """Arrays cut in one pass (`GgufFile._array_parts`): of strings (an empty one and non-ASCII ones too), of each
    number type and of bools, and an empty array; an array of arrays is left to gguf's reader. Each reads as gguf's
    reader reads it."""
    from gguf import GGUFValueType, GGUFWriter

    path = tmp_path / "arrays.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_array("t.strings", ["", "a", "ünïcode ✓", "x" * 300])
    writer.add_array("t.empty", [])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_array("t.bools", [True, False, True])
    for kind in (GGUFValueType.UINT8, GGUFValueType.INT16, GGUFValueType.UINT32, GGUFValueType.INT64,
                 GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):  # fmt: skip
        writer.add_key_value(f"t.{kind.name.lower()}", [1, 2, 3, 100], GGUFValueType.ARRAY, sub_type=kind)
    writer.add_uint32("t.after", 7)  # read at the offset the arrays end at
    writer.add_tensor("w", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = GgufFile(path), GGUFReader(path)
    assert_fields_equal(ours, theirs)
    assert ours.fields["t.after"].contents() == 7 and ours.fields["t.strings"].contents()[2] == "ünïcode ✓"
    assert np.array_equal(ours.tensors[0].data, theirs.tensors[0].data)
    # An empty array (gguf's writer writes none; older writers did): a one-item array's count set to 0, its item cut.
    empty = tmp_path / "empty.gguf"
    writer = GGUFWriter(str(empty), "llama")
    writer.add_key_value("t.empty", [7], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    emptied(empty, "t.empty")
    ours, theirs = GgufFile(empty), GGUFReader(empty)
    assert_fields_equal(ours, theirs)
    assert ours.fields["t.empty"].contents() == []


def test_gguf_file_reads_every_field_and_tensor_as_ggufs_reader() -> None:
    """`GgufFile` (gguf's reader over a plain array of the file's pages, the converter's) gives every metadata value
    of the embedded model (its 49,152 tokens and 48,900 merges too) and every tensor as gguf's own reader does."""
    theirs, ours = GGUFReader(default_gguf_path()), GgufFile(default_gguf_path())
    assert_fields_equal(ours, theirs)
    described = [(t.name, t.tensor_type, t.data.shape, t.data_offset, t.n_bytes) for t in theirs.tensors]
    assert [(t.name, t.tensor_type, t.data.shape, t.data_offset, t.n_bytes) for t in ours.tensors] == described
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors, strict=True))
    assert not ours.tensors[0].data.flags.writeable  # the file's pages, read-only


def test_transformers_reads_its_metadata_from_the_parsed_fields_as_from_the_file(tmp_path: Path) -> None:
    """transformers 5's own GGUF reader, answered from `GgufFile`'s fields during a conversion
    (`transformers_metadata`): every key of the embedded model's file with the same value of the same type, its
    vocabulary and merges decoded when asked for and counted otherwise, and the tensors' names; a file holding an
    array of arrays or an empty array is left to transformers' reader (None)."""
    reader_module = pytest.importorskip("transformers.integrations.gguf.reader")
    path = default_gguf_path()
    for arrays in ((), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")):
        ours = transformers_metadata(GgufFile(path), arrays)
        theirs = reader_module.read_gguf_metadata(str(path), arrays)
        assert ours == theirs
        assert ours is not None and [type(v) for v in ours[0].values()] == [type(v) for v in theirs[0].values()]
    assert isinstance(theirs[0]["tokenizer.ggml.tokens"], list) and len(theirs[0]["tokenizer.ggml.tokens"]) == 49152
    from gguf import GGUFValueType, GGUFWriter

    for name, value in (("nested", [[1, 2], [3]]), ("empty", [7])):
        odd = tmp_path / f"{name}.gguf"
        writer = GGUFWriter(str(odd), "llama")
        writer.add_array("t.odd", value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        if name == "empty":  # gguf's writer writes none
            emptied(odd, "t.odd")
            assert GgufFile(odd).fields["t.odd"].types == [GGUFValueType.ARRAY]
        assert transformers_metadata(GgufFile(odd)) is None, name
