"""The Triton op set as a whole: dispatch, the interpreter actually in use, a model forward, GPU compilation."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from engine_server.attention_metadata import AttentionMetadata, allocate_kv_cache
from engine_server.config import ModelConfig
from engine_server.hf_config import model_config_from_hf
from engine_server.layers.kernel_choice import select_ops
from engine_server.models import get_model_class
from ladle_kernels import activation, bitmask, kv_cache, paged_attention, reference, rms_norm, rotary, seeded_noise
from ladle_kernels.kernel_set import REFERENCE_OPS, KernelOps
from ladle_kernels.triton_ops import TRITON_OPS

HAS_CUDA = torch.cuda.is_available()
KERNELS = [
    activation._silu_and_mul_kernel,
    bitmask._apply_token_bitmask_kernel,
    kv_cache._write_kv_cache_kernel,
    paged_attention._paged_attention_kernel,
    rms_norm._rms_norm_kernel,
    rotary._rotary_kernel,
    seeded_noise._seeded_log_uniforms_kernel,
]
REPO = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(HAS_CUDA, reason="with CUDA the kernels are compiled, not interpreted")
def test_kernels_run_through_the_interpreter_without_cuda() -> None:
    """Guards the conftest's TRITON_INTERPRET: a kernel module imported before it would hold compiled kernels."""
    assert all(isinstance(kernel, InterpretedFunction) for kernel in KERNELS)


def test_triton_ops_mirror_the_reference_signatures() -> None:
    for field in fields(KernelOps):
        ours, ref = getattr(TRITON_OPS, field.name), getattr(reference, field.name)
        assert ours.__name__ == field.name
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(ref).parameters)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_select_ops_picks_triton_on_cuda() -> None:
    assert select_ops(torch.device("cuda")) is TRITON_OPS


def tiny_config(architecture: str) -> ModelConfig:
    """Two layers; Qwen3 adds q/k norm on strided heads, a GQA group of 3 and a head dim (24) padded to 32."""
    qwen3 = architecture == "qwen3"
    return ModelConfig(
        architecture="qwen3" if qwen3 else "llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6 if qwen3 else 4,
        num_key_value_heads=2,
        head_dim=24 if qwen3 else 16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        qk_norm=qwen3,
    )


# DeepSeek-V3's latent attention (dense layers): the cache's rows its 512-dim latent and 64 rope dims, as V3's.
TINY_DEEPSEEK = model_config_from_hf({
    "model_type": "deepseek_v3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 64, "v_head_dim": 16, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 2, "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
})  # fmt: skip


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "deepseek_v3"])
def test_model_forward_with_triton_ops_matches_reference(device: torch.device, architecture: str) -> None:
    """Two engine steps (prompts, then a decode beside a prompt chunk and a new prompt) through both op sets."""
    config = TINY_DEEPSEEK if architecture == "deepseek_v3" else tiny_config(architecture)
    torch.manual_seed(0)
    with torch.device(device):
        model = get_model_class(config.architecture)(config).eval()
    with torch.no_grad():  # a model is built uninitialised (weights are loaded next): random weights, norms near 1
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    caches = {ops: allocate_kv_cache(config, 8, 16, torch.float32, device) for ops in ("reference", "triton")}
    tables = [[3, 5], [1, 6, 2], [7]]
    steps = [  # (query_lens, seq_lens) per step; sequence 2 starts in the second step
        ([5, 19], [5, 19], tables[:2]),
        ([1, 3, 7], [6, 22, 7], tables),
    ]
    gen = torch.Generator().manual_seed(1)
    for query_lens, seq_lens, step_tables in steps:
        meta = AttentionMetadata.build(query_lens, seq_lens, step_tables, 16, device)
        ids = torch.randint(0, config.vocab_size, (meta.num_tokens,), generator=gen).to(device)
        positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)]).to(device)
        hidden = {}
        for name, ops in (("reference", REFERENCE_OPS), ("triton", TRITON_OPS)):
            model.ops = ops
            with torch.inference_mode():
                hidden[name] = model(ids, positions, caches[name], meta)
        torch.testing.assert_close(hidden["triton"], hidden["reference"], atol=1e-4, rtol=1e-4)
    for ours, ref in zip(caches["triton"], caches["reference"], strict=True):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_sampler_bitmask_takes_the_kernel_on_cuda() -> None:
    from engine_server.sampling import logits_transforms

    logits = torch.randn(3, 1000, device="cuda")
    mask = torch.randint(-(2**31), 2**31 - 1, (3, 32), dtype=torch.int32, device="cuda")
    expected = logits.clone()
    reference.apply_token_bitmask_(expected, mask)
    logits_transforms.apply_token_bitmask_(logits, mask)
    assert logits_transforms._triton_bitmask() is bitmask.apply_token_bitmask_
    assert torch.equal(logits, expected)


@pytest.mark.skipif(HAS_CUDA, reason="the GPU tests run the kernels for real")
def test_kernels_compile_for_hopper() -> None:
    """What the interpreter cannot check (tl.dot limits, shared memory, types in loops), by compiling to a cubin."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    script = Path(__file__).with_name("compile_for_gpu.py")
    result = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    if result.returncode == 3:
        pytest.skip(f"triton {triton.__version__} cannot compile for CUDA here: {result.stderr.strip()[-300:]}")
    assert result.returncode == 0, result.stdout + result.stderr
