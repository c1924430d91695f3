"""Embeddings on the float path equal transformers' pooled hidden states (fp32, 1e-5 relative), for the embedded
model (last token), small Qwen3-Embedding-style folders (last, mean and cls; chunked prefill, prefix cache) and
small BERT encoders (mean, cls; inputs whole, packed several to a step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine_server import LLM, ChatPrompt
from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_server.errors import UnsupportedByModelError, ValidationError
from engine_server.loader import resolve_model
from engine_server.pooling.params import PoolingMethod
from engine_server.tokenizer.chat import ChatMessage
from tests.families import float_checkpoint
from tests.unit.pooling.embedding_models import (
    load_reference,
    reference_embedding,
    reference_pair_scores,
    save_bert,
    save_qwen3_embedding,
)

pytestmark = pytest.mark.slow  # the embedded model and transformers' pooling

TEXTS = [
    "Hello world",
    "The capital of France is Paris, a city on the Seine with many museums and bridges.",
    "a",
    "Embeddings turn text into vectors; similar texts get vectors that point the same way. " * 4,
]
RTOL = 1e-5


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Within 1e-5 relative to the vector's size (elementwise relative error is meaningless near 0)."""
    error = float((ours - theirs).norm() / theirs.norm())
    assert error <= RTOL, f"relative error {error:.2e}"


@pytest.fixture(scope="module")
def hf_embedded() -> Any:
    """transformers' bare decoder on the weights the engine loads, fp32: the embedded GGUF file's tensors dequantized,
    which tests/unit/test_loader.py holds to transformers' own GGUF loader (every tensor to 1e-6)."""
    from transformers import AutoModel

    with float_checkpoint(resolve_model("default")) as folder:
        return AutoModel.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()


def test_the_embedded_model_embeds_as_transformers_last_token_normalized(llm: LLM, hf_embedded: Any) -> None:
    assert llm.pooling.method is PoolingMethod.LAST and llm.pooling.normalize
    vectors = llm.embed(TEXTS, use_tqdm=False)
    for text, vector in zip(TEXTS, vectors, strict=True):
        ids = llm.tokenizer.encode(text)
        _assert_close(vector, reference_embedding(hf_embedded, ids, "lasttoken", normalize=True))
        assert vector.shape == (576,)
        assert abs(float(vector.norm()) - 1.0) < 1e-5


def test_dimensions_truncate_before_normalizing_and_normalize_false_is_raw(llm: LLM, hf_embedded: Any) -> None:
    ids = llm.tokenizer.encode(TEXTS[1])
    raw = reference_embedding(hf_embedded, ids, "lasttoken", normalize=False)
    (short,) = llm.embed([TEXTS[1]], dimensions=64, use_tqdm=False)
    _assert_close(short, torch.nn.functional.normalize(raw[:64], dim=0))
    (unnormalized,) = llm.embed([ids], normalize=False, use_tqdm=False)  # token ids in, as given
    _assert_close(unnormalized, raw)
    (short_raw,) = llm.embed([ids], normalize=False, dimensions=10, use_tqdm=False)
    _assert_close(short_raw, raw[:10])


def test_chat_input_is_embedded_from_its_template(llm: LLM, hf_embedded: Any) -> None:
    chat = ChatPrompt([ChatMessage(role="user", content="What is an embedding?")], add_generation_prompt=False)
    (vector,) = llm.embed([chat], use_tqdm=False)
    ids = llm.inputs.tokenize(chat)
    _assert_close(vector, reference_embedding(hf_embedded, ids, "lasttoken", normalize=True))


def test_score_orders_documents_as_transformers_cosines(llm: LLM, hf_embedded: Any) -> None:
    query = "Which city is the capital of France?"
    documents = ["Paris is the capital of France.", "Bananas are rich in potassium.", "France borders Spain."]
    scores = llm.score(query, documents, use_tqdm=False)

    def ref(text: str) -> torch.Tensor:
        return reference_embedding(hf_embedded, llm.tokenizer.encode(text), "lasttoken", normalize=True)

    expected = [float(ref(query) @ ref(doc)) for doc in documents]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert sorted(range(3), key=lambda i: -scores[i]) == sorted(range(3), key=lambda i: -expected[i])


def test_bad_pooling_requests_are_refused_before_anything_runs(llm: LLM) -> None:
    with pytest.raises(ValidationError, match="dimensions") as error:
        llm.embed(["x"], dimensions=577, use_tqdm=False)
    assert error.value.param == "dimensions"
    with pytest.raises(ValidationError, match="empty"):
        llm.embed([""], use_tqdm=False)
    with pytest.raises(ValidationError, match="context length"):
        llm.embed([[1] * (llm.core.max_model_len + 1)], use_tqdm=False)
    (kept,) = llm.embed([[1] * (llm.core.max_model_len + 1)], truncate_prompt_tokens=8, use_tqdm=False)
    (last8,) = llm.embed([[1] * 8], use_tqdm=False)
    assert torch.equal(kept, last8)


# -- Qwen3-Embedding-style folders -------------------------------------------------------------------------


def _folder_llm(folder: Path, chunk: int = 32) -> LLM:
    """An engine on `folder` whose prompts run in chunks of `chunk` tokens, with the prefix cache on."""
    config = EngineConfig(
        model=str(folder),
        device="cpu",
        quantization="none",
        cache=CacheConfig(memory_bytes=64 * 1024**2, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk, batch_min_prefill_chunk=chunk),
    )
    return LLM(config=config)


@pytest.mark.parametrize(("pooling", "normalize"), [("lasttoken", True), ("mean_tokens", False), ("cls_token", True)])
def test_a_qwen3_embedding_folder_pools_as_its_sentence_transformers_config(
    tmp_path: Path, pooling: str, normalize: bool
) -> None:
    folder = save_qwen3_embedding(tmp_path / "qwen3-embedding", pooling=pooling, normalize=normalize)
    reference = load_reference(folder)
    llm = _folder_llm(folder)
    assert (llm.pooling.method.value, llm.pooling.normalize, llm.pooling.dimensions) == (
        {"lasttoken": "last", "mean_tokens": "mean", "cls_token": "cls"}[pooling],
        normalize,
        64,
    )
    # Twice: the second time the prompts' full blocks are in the prefix cache, which mean and cls must not use.
    for _ in range(2):
        vectors = llm.embed(TEXTS, use_tqdm=False)  # the long text runs in several 32-token chunks
        for text, vector in zip(TEXTS, vectors, strict=True):
            ids = llm.tokenizer.encode(text)
            _assert_close(vector, reference_embedding(reference, ids, pooling, normalize))
    llm.close()


def test_a_folder_without_sentence_transformers_files_pools_its_last_token_normalized(tmp_path: Path) -> None:
    folder = save_qwen3_embedding(tmp_path / "bare", pooling=None)
    reference = load_reference(folder)
    llm = _folder_llm(folder, chunk=2048)
    assert (llm.pooling.method, llm.pooling.normalize) == (PoolingMethod.LAST, True)
    (vector,) = llm.embed([TEXTS[3]], use_tqdm=False)
    _assert_close(vector, reference_embedding(reference, llm.tokenizer.encode(TEXTS[3]), "lasttoken", True))
    llm.close()


# -- BERT-style encoders -------------------------------------------------------------------------------------

BERT_TEXTS = [
    "Hello world",
    "The capital of France is Paris, a city on the Seine with many museums and bridges.",
    "a",
    "Bananas are yellow.",
    "Embeddings turn text into vectors; similar texts get vectors that point the same way.",
]


@pytest.mark.parametrize(("pooling", "normalize"), [("mean_tokens", True), ("cls_token", False), (None, True)])
def test_a_bert_encoder_pools_as_transformers(tmp_path: Path, pooling: str | None, normalize: bool) -> None:
    """Every input whole in one step (a 32-token budget packs several per step, padded per layer), twice (the
    prefix cache must not serve an encoder's tokens); without sentence-transformers files, CLS normalized."""
    folder = save_bert(tmp_path / "bert", pooling=pooling, normalize=normalize)
    reference = load_reference(folder)
    llm = _folder_llm(folder, chunk=32)
    expected_method = {"mean_tokens": "mean", "cls_token": "cls", None: "cls"}[pooling]
    assert (llm.pooling.method.value, llm.pooling.normalize, llm.pooling.encoder) == (expected_method, normalize, True)
    assert llm.core.max_model_len == 32  # an input runs whole: at most one step's budget
    for _ in range(2):
        vectors = llm.embed(BERT_TEXTS, use_tqdm=False)
        for text, vector in zip(BERT_TEXTS, vectors, strict=True):
            ids = llm.tokenizer.encode(text)
            assert len(ids) <= 32
            _assert_close(vector, reference_embedding(reference, ids, pooling or "cls_token", normalize))
    with pytest.raises(ValidationError, match="context length"):
        llm.embed(["hello " * 40], use_tqdm=False)
    with pytest.raises(UnsupportedByModelError, match="encoder"):
        llm.generate(["Hello"], use_tqdm=False)
    llm.close()


def test_an_encoder_refuses_quantized_weights_and_tensor_parallelism(tmp_path: Path) -> None:
    folder = save_bert(tmp_path / "bert", pooling=None)
    with pytest.raises(ValueError, match="encoder"):
        LLM(config=EngineConfig(model=str(folder), device="cpu", quantization="int8"))
    with pytest.raises(ValueError, match="encoder"):
        LLM(config=EngineConfig(model=str(folder), device="cpu", tensor_parallel_size=2))


def test_a_cross_encoder_scores_pairs_as_transformers(tmp_path: Path) -> None:
    """Score on a BertForSequenceClassification: each (query, document) pair typed 0/1 around its first [SEP],
    through the pooler and classifier, sigmoid; ordering and values as transformers'."""
    from transformers import AutoModelForSequenceClassification

    folder = save_bert(tmp_path / "cross", pooling=None, cross_encoder=True)
    reference = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    llm = _folder_llm(folder, chunk=64)
    assert llm.pooling.cross_encoder
    query = "what is the capital of france"
    documents = ["Paris is the capital of France.", "Bananas are yellow.", "France borders Spain.", "Hello world"]
    scores = llm.score(query, documents, use_tqdm=False)
    expected = reference_pair_scores(folder, reference, query, documents)
    assert scores == pytest.approx(expected, abs=1e-5)
    assert sorted(range(4), key=lambda i: -scores[i]) == sorted(range(4), key=lambda i: -expected[i])
    assert len(set(round(s, 4) for s in expected)) == 4  # the pairs differ: the ordering means something
    with pytest.raises(ValidationError, match="text"):
        llm.score(query, [[5, 6, 7]], use_tqdm=False)
    llm.close()


def test_an_embedding_gguf_keeps_its_pooling_type(tmp_path: Path) -> None:
    """A GGUF embedding model (llama.cpp's `{arch}.pooling_type`) converts with its pooling: mean here, and its
    vectors equal transformers' on the converted folder."""
    from gguf import PoolingType

    from engine_server.config import ModelConfig
    from engine_server.loader import default_cache_dir, resolve_model
    from engine_server.loader.dummy import random_tensor
    from engine_server.loader.layout import parameter_shapes
    from tests.unit.test_loader import write_tiny_gguf

    tiny = ModelConfig(
        architecture="qwen3", vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=256, tie_word_embeddings=True, qk_norm=True,
    )  # fmt: skip
    state = {name: random_tensor(name, shape, seed=5) * 4 for name, shape in parameter_shapes(tiny).items()}
    path = tmp_path / "tiny-embedding.gguf"
    default = resolve_model("default")
    write_tiny_gguf(path, tiny, state, default.tokenizer_path, pooling_type=PoolingType.MEAN)
    llm = LLM(config=EngineConfig(model=str(path), device="cpu", quantization="none", cache_dir=str(tmp_path)))
    assert (llm.pooling.method, llm.pooling.normalize) == (PoolingMethod.MEAN, True)
    # Converted into the engine's cache_dir alone, not also into the default cache (the frontend's resolve once did).
    assert [entry.name.startswith("tiny-embedding-") for entry in (tmp_path / "gguf").iterdir()] == [True]
    assert not list(default_cache_dir().glob("gguf/tiny-embedding-*"))
    source = resolve_model(str(path), cache_dir=tmp_path)
    with float_checkpoint(source) as folder:
        reference = load_reference(folder)
    text = "the cat sat on the mat"
    (vector,) = llm.embed([text], use_tqdm=False)
    _assert_close(vector, reference_embedding(reference, llm.tokenizer.encode(text), "mean_tokens", True))
    llm.close()
