"""Whisper (`engine_server.multimodal.whisper`, `models.whisper`): a tiny random `WhisperForConditionalGeneration`
(d_model 64, 2 encoder and 2 decoder layers, its matrices drawn wide so outputs vary, its biases and norms drawn
too) saved by transformers with a
`WhisperTokenizer` built offline (a byte-level BPE vocabulary of its own and Whisper's special tokens), a
`WhisperFeatureExtractor` and a generation config with `lang_to_id`, `task_to_id`, `suppress_tokens` and
`begin_suppress_tokens`. The oracle is transformers' own `model.generate(input_features, language=..., task=...,
prompt_ids=...)` on the clip as the engine hears it (decoded by soundfile, mixed down, resampled to 16 kHz by soxr):
greedy tokens equal for transcribe, translate, a previous-text prompt and a detected language, batched, prefilled in
chunks, preempted in a small KV pool, and for two clips behind the same prompt (the prefix cache keeps them apart).
The int8 default runs and gives each clip the same tokens alone as batched. What is not served is refused by name."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_server.errors import ValidationError
from engine_server.frontend import LanguageDetection
from engine_server.llm import LLM
from engine_server.multimodal.transcription import TranscriptionPrompt
from engine_server.sampling_params import SamplingParams
from tests.unit.test_audio_input import clip, heard
from tests.unit.test_family_engines import engine

pytestmark = pytest.mark.slow  # engines and transformers' models of their own

LANGUAGES = ("en", "de", "fr", "es")
_SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", *[f"<|{code}|>" for code in LANGUAGES], "<|translate|>",
             "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]  # fmt: skip
_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("a", "t"), ("Ġ", "c"), ("Ġc", "at")]
TIMESTAMPS = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]  # <|0.00|> to <|30.00|>
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
# A previous text long enough for a whole KV block of the prompt (16 tokens) before the clip's tokens.
PREVIOUS = "the cat sat at the mat, the hat at the cat"


def whisper_tokenizer(folder: Path, timestamps: bool = False) -> Any:
    """A `WhisperTokenizer` over a byte-level vocabulary (every byte, a few merges), Whisper's special tokens and
    (`timestamps`) its timestamp tokens, saved in `folder`."""
    import transformers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    for first, second in _MERGES:
        vocab[first + second] = len(vocab)
    tokenizer = transformers.WhisperTokenizer(vocab=vocab, merges=_MERGES)
    tokenizer.add_special_tokens({"additional_special_tokens": _SPECIALS})
    if timestamps:
        tokenizer.add_tokens(TIMESTAMPS)  # (after `<|notimestamps|>`, not special: as Whisper's own vocabularies)
    tokenizer.save_pretrained(folder)
    return tokenizer


def save_whisper(folder: Path, timestamps: bool = False) -> Any:
    """A tiny Whisper checkpoint saved in `folder` as transformers saves it (with `timestamps`, its vocabulary has
    Whisper's timestamp tokens: `test_whisper_timestamps`); returns the model."""
    import transformers

    tokenizer = whisper_tokenizer(folder, timestamps)
    ids = {token: int(tokenizer.convert_tokens_to_ids(token)) for token in _SPECIALS}
    eos = ids["<|endoftext|>"]
    config = transformers.WhisperConfig(
        vocab_size=len(tokenizer), d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80, max_target_positions=64,
        decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=eos, pad_token_id=eos, bos_token_id=eos,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # matrices wide, biases and norms off their zeros and ones (so that a lost bias shows)
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.25)
            elif "layer_norm" in name and name.endswith("weight"):
                parameter.normal_(1.0, 0.2)
            else:
                parameter.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    generation = transformers.GenerationConfig(
        decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=eos, pad_token_id=eos, bos_token_id=eos,
        lang_to_id={f"<|{code}|>": ids[f"<|{code}|>"] for code in LANGUAGES},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"], prev_sot_token_id=ids["<|startofprev|>"],
        is_multilingual=True, suppress_tokens=[5, 88], begin_suppress_tokens=[220, eos, 107, 50], max_length=64,
        max_initial_timestamp_index=50,
    )  # fmt: skip
    generation.save_pretrained(folder)
    model.generation_config = generation
    transformers.WhisperFeatureExtractor(feature_size=80).save_pretrained(folder)
    return model


def reference(
    folder: Path, model: Any, prompt: TranscriptionPrompt, new: int = NEW_TOKENS
) -> tuple[list[int], list[int]]:
    """transformers' decoder prompt (its tokenizer's `get_prompt_ids`, then `<|startoftranscript|>`, the language's
    token, `detect_language`'s where the prompt names none, the task's and `<|notimestamps|>`) and greedy output
    tokens (`generate`) for `prompt`."""
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor.from_pretrained(folder)
    features = extractor(heard(prompt.audio), sampling_rate=16_000, return_tensors="pt").input_features
    kwargs: dict[str, Any] = {"task": prompt.task, "language": prompt.language or None}
    tokenizer = AutoTokenizer.from_pretrained(folder)
    previous = [int(t) for t in tokenizer.get_prompt_ids(prompt.prompt)] if prompt.prompt else []
    if previous:
        kwargs["prompt_ids"] = torch.tensor(previous)
    generation = model.generation_config
    with torch.inference_mode():
        out = model.generate(features, max_new_tokens=new, do_sample=False, **kwargs)
        language = int(model.detect_language(features)[0]) if not prompt.language else \
            generation.lang_to_id[f"<|{TO_LANGUAGE_CODE.get(prompt.language, prompt.language)}|>"]  # fmt: skip
    ids = [*previous, generation.decoder_start_token_id, language, generation.task_to_id[prompt.task],
           generation.no_timestamps_token_id]  # fmt: skip
    return ids, [int(t) for t in out[0]]


def reference_timestamps(
    folder: Path, model: Any, prompt: TranscriptionPrompt, new: int = NEW_TOKENS
) -> tuple[list[int], list[int]]:
    """transformers' decoder prompt (`reference`'s, without `<|notimestamps|>` where `prompt.timestamps`; `prompt`
    names its language) and greedy tokens of one decode (under its `WhisperTimeStampLogitsProcessor` where
    `prompt.timestamps`, after the generation config's suppressions, as Whisper's `generate` orders them), through
    `GenerationMixin.generate`: the one decode a window gets. (Whisper's own `generate` decodes again from a timestamp
    the model writes, its sequential decoding, which a random model's timestamps set off.)"""
    from transformers import GenerationMixin, LogitsProcessorList, WhisperFeatureExtractor
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    ids = reference(folder, model, prompt, new=1)[0]  # (its language given: no detection)
    if prompt.timestamps:
        ids = ids[:-1]
    extractor = WhisperFeatureExtractor.from_pretrained(folder)
    features = extractor(heard(prompt.audio), sampling_rate=16_000, return_tensors="pt").input_features
    rules = [WhisperTimeStampLogitsProcessor(model.generation_config, len(ids))] if prompt.timestamps else []
    with torch.inference_mode():
        out = GenerationMixin.generate(model, input_features=features, decoder_input_ids=torch.tensor([ids]),
                                       logits_processor=LogitsProcessorList(rules), max_new_tokens=new,
                                       do_sample=False)  # fmt: skip
    return ids, [int(t) for t in out[0, len(ids):]]


@contextlib.asynccontextmanager
async def grpc_served(folder: Path, max_num_seqs: int | None = None) -> AsyncIterator[tuple[Any, Any]]:
    """The Whisper in `folder` (float, a 64 MiB KV pool; at most `max_num_seqs` sequences a step where given) loaded
    by `ServingEngine` behind the gRPC servicer on loopback: a stub to call it and the engine; both closed after."""
    import grpc

    from engine_server.server.servicer import EngineServicer
    from engine_server.server.serving import ServingEngine
    from ladle.v1 import engine_pb2_grpc

    scheduler = SchedulerConfig() if max_num_seqs is None else SchedulerConfig(max_num_seqs=max_num_seqs)
    config = EngineConfig(model=str(folder), device="cpu", quantization="none",
                          cache=CacheConfig(memory_bytes=64 * 1024**2), scheduler=scheduler)  # fmt: skip
    engine = await asyncio.to_thread(ServingEngine.load, config, asyncio.get_running_loop())
    servicer = EngineServicer()
    servicer.attach(engine)
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield engine_pb2_grpc.EngineServiceStub(channel), engine
    finally:
        await server.stop(None)
        await engine.close()


def generate_and_stream(folder: Path, message: Any, sampling: Any) -> tuple[Any, list[Any]]:
    """The Generate reply and the Stream messages of one `Input` (`message`, with `sampling`) to the Whisper in
    `folder` served over gRPC (`grpc_served`)."""
    from ladle.v1 import engine_pb2

    async def served() -> tuple[Any, list[Any]]:
        async with grpc_served(folder) as (stub, _):
            whole = await stub.Generate(engine_pb2.GenerateRequest(input=message, sampling=sampling), timeout=60)
            stream = [m async for m in stub.Stream(engine_pb2.StreamRequest(input=message, sampling=sampling),
                                                   timeout=60)]  # fmt: skip
        return whole, stream

    return asyncio.run(served())


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("whisper")
    return folder, save_whisper(folder)


@pytest.fixture(scope="module")
def served(whisper: tuple[Path, Any]) -> Iterator[LLM]:
    with engine(whisper[0]) as llm:
        yield llm


CASES = {
    "transcribe": lambda: TranscriptionPrompt(clip(1, 1.5), "en"),
    "translate": lambda: TranscriptionPrompt(clip(2, 2.5, 8_000), "german", "translate"),
    "previous text": lambda: TranscriptionPrompt(clip(3, 0.8, 44_100, 2, "FLAC"), "fr", prompt=PREVIOUS),
    "detected": lambda: TranscriptionPrompt(clip(4, 3.0, 22_050)),
}


def engine_in(folder: Path, chunk: int = 2048, kv_blocks: int = 0, quantization: str = "none") -> LLM:
    """The offline engine on `folder` (max_model_len the model's 64 positions); `kv_blocks`: a KV pool of that many
    16-token blocks of the 2-layer model instead of 64 MiB."""
    memory = kv_blocks * 2 * 2 * 16 * 4 * 16 * 4 if kv_blocks else 64 * 1024**2  # layers, K/V, block, heads, dim, f32
    return LLM(config=EngineConfig(
        model=str(folder), device="cpu", quantization=quantization, cache=CacheConfig(memory_bytes=memory),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk),
    ))  # fmt: skip


def prompts() -> list[TranscriptionPrompt]:
    return [CASES[case]() for case in sorted(CASES)]


@pytest.mark.parametrize("chunk", [2048, 3])
def test_transcriptions_equal_transformers_generate(chunk: int, whisper: tuple[Path, Any]) -> None:
    """Transcribe, translate (a language by name), a previous-text prompt (a 44.1 kHz stereo FLAC) and a detected
    language (22.05 kHz), batched, whole and in chunks of 3: each prompt's ids and greedy tokens are transformers',
    and each result says its language and clip length."""
    folder, model = whisper
    batch = prompts()
    expected = [reference(folder, model, prompt) for prompt in batch]
    with engine_in(folder, chunk=chunk) as llm:
        results = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [result.prompt_token_ids for result in results] == [ids for ids, _ in expected]
    assert [result.choices[0].token_ids for result in results] == [tokens for _, tokens in expected]
    infos = [result.transcription for result in results]
    assert all(info is not None for info in infos)
    assert [info.language for info in infos if info is not None][:3] == ["es", "fr", "en"]  # (detected, given)
    assert [round(info.duration_seconds, 3) for info in infos if info is not None] == [3.0, 0.8, 1.5, 2.5]


def test_preempted_transcriptions_answer_as_transformers_does(whisper: tuple[Path, Any]) -> None:
    """Eight clips, 30 new tokens each, in a pool of 10 blocks, 8 tokens a step: requests are preempted and recomputed
    (their K/V kept meanwhile, released at the end); each answer is transformers'."""
    folder, model = whisper
    batch = [TranscriptionPrompt(clip(40 + i, 0.5 + 0.3 * i), LANGUAGES[i % 4], prompt="the cat" * (i % 2))
             for i in range(8)]  # fmt: skip
    expected = [reference(folder, model, prompt, 30)[1] for prompt in batch]
    with engine_in(folder, chunk=8, kv_blocks=10) as llm:
        results = llm.generate(batch, dataclasses.replace(GREEDY, max_tokens=30), use_tqdm=False)
        assert llm.core.scheduler.total_preemptions > 0
        assert llm.core.runner.cross_states is not None and llm.core.runner.cross_states.num_requests == 0
    assert [result.choices[0].token_ids for result in results] == expected


def test_the_prefix_cache_keeps_apart_clips_behind_the_same_prompt(whisper: tuple[Path, Any], served: LLM) -> None:
    """The same previous text and language with the same clip again is served from the prefix cache with the same
    answer; with another clip (the same ids) it is not, and answers as transformers does for that clip."""
    folder, model = whisper
    first = TranscriptionPrompt(clip(5, 1.0), "en", prompt=PREVIOUS)
    other = dataclasses.replace(first, audio=clip(6, 1.0))
    again = [served.generate([prompt], GREEDY, use_tqdm=False)[0] for prompt in (first, first, other)]
    assert again[0].prompt_token_ids == again[2].prompt_token_ids and len(again[0].prompt_token_ids) > 16
    assert again[1].usage.cached_prompt_tokens >= 16 and again[2].usage.cached_prompt_tokens == 0
    assert [r.choices[0].token_ids for r in again] == [reference(folder, model, p)[1] for p in (first, first, other)]
    assert again[0].choices[0].token_ids != again[2].choices[0].token_ids  # (the clip is heard)


def test_an_english_only_checkpoint_lays_out_no_language_or_task_token(
    whisper: tuple[Path, Any], tmp_path: Path
) -> None:
    """A generation config without `lang_to_id` and `task_to_id` (an `.en` checkpoint's): the prompt is
    `<|startoftranscript|><|notimestamps|>` and the tokens transformers' for no language and no task; English (or none)
    is served, another language and translation are refused by name."""
    import json
    import shutil

    folder, model = whisper
    english = tmp_path / "english"
    shutil.copytree(folder, english)
    generation = json.loads((english / "generation_config.json").read_text())
    for key in ("lang_to_id", "task_to_id", "is_multilingual"):
        generation.pop(key, None)
    (english / "generation_config.json").write_text(json.dumps(generation))
    prompt = CASES["transcribe"]()
    from transformers import GenerationConfig, WhisperFeatureExtractor

    features = WhisperFeatureExtractor.from_pretrained(folder)(heard(prompt.audio), sampling_rate=16_000,
                                                               return_tensors="pt").input_features  # fmt: skip
    saved = model.generation_config
    model.generation_config = GenerationConfig.from_pretrained(english)
    try:
        with torch.inference_mode():
            expected = [int(t) for t in model.generate(features, max_new_tokens=NEW_TOKENS, do_sample=False)[0]]
    finally:
        model.generation_config = saved
    with engine_in(english) as llm:
        results = llm.generate([prompt, dataclasses.replace(prompt, language="")], GREEDY, use_tqdm=False)
        for refused, param in ((dataclasses.replace(prompt, language="de"), "language"),
                               (dataclasses.replace(prompt, task="translate"), "task")):  # fmt: skip
            with pytest.raises(ValidationError, match="English-only") as error:
                llm.generate([refused], GREEDY, use_tqdm=False)
            assert error.value.param == f"input.transcription.{param}"
    start, no_timestamps = saved.decoder_start_token_id, saved.no_timestamps_token_id
    assert [r.prompt_token_ids for r in results] == [[start, no_timestamps]] * 2
    assert [r.choices[0].token_ids for r in results] == [expected] * 2
    assert [r.transcription.language for r in results if r.transcription is not None] == ["en", "en"]


def test_a_detected_language_encodes_its_clip_once(whisper: tuple[Path, Any]) -> None:
    """A transcription naming no language: its detection's encoder states are kept for it, so the encoder runs once
    for the pair, and the answer is transformers'; past KEPT_DETECTIONS, the oldest kept states are dropped."""
    from engine_server.multimodal import whisper as whisper_states

    folder, model = whisper
    prompt = CASES["detected"]()
    with engine_in(folder) as llm:
        states = llm.core.runner.cross_states
        assert isinstance(states, whisper_states.WhisperCrossStates)
        encoded: list[int] = []
        encode = states.encoder.encode
        states.encoder.encode = lambda *args, **kwargs: encoded.append(1) or encode(*args, **kwargs)  # type: ignore
        (result,) = llm.generate([prompt], GREEDY, use_tqdm=False)
        assert len(encoded) == 1 and states.num_requests == 0 and not states._kept
        assert result.choices[0].token_ids == reference(folder, model, prompt)[1]
        more = [TranscriptionPrompt(clip(60 + i, 0.5)) for i in range(whisper_states.KEPT_DETECTIONS + 2)]
        detections = [LanguageDetection(p) for p in more]
        llm.generate(detections, SamplingParams(max_tokens=1), use_tqdm=False)
        assert len(states._kept) == whisper_states.KEPT_DETECTIONS


def test_max_tokens_is_capped_by_the_decoders_positions(served: LLM) -> None:
    """A max_tokens past what the 64 positions leave after the prompt is capped there, not refused."""
    prompt = CASES["previous text"]()
    (result,) = served.generate([prompt], SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True),
                                use_tqdm=False)  # fmt: skip
    assert len(result.prompt_token_ids) + len(result.choices[0].token_ids) == 64


def test_int8_runs_batch_invariant(whisper: tuple[Path, Any]) -> None:
    """With int8 weights (the decoder's; the encoder and cross-attention in float) each clip gets the same tokens
    alone as batched with the others."""
    folder, _ = whisper
    batch = prompts()
    with engine_in(folder, quantization="int8") as llm:
        batched = [result.choices[0].token_ids for result in llm.generate(batch, GREEDY, use_tqdm=False)]
        alone = [llm.generate([prompt], GREEDY, use_tqdm=False)[0].choices[0].token_ids for prompt in batch]
    assert batched == alone and all(len(tokens) == NEW_TOKENS for tokens in batched)


@pytest.mark.parametrize(
    ("prompt", "message", "param"),
    [
        (TranscriptionPrompt(b"not audio", "en"), "cannot be read", "input.transcription.audio"),
        (TranscriptionPrompt(clip(8, 1.0), "klingon"), "language 'klingon' is not one this model knows",
         "input.transcription.language"),
        (TranscriptionPrompt(clip(8, 1.0), "en", "summarize"), "task 'summarize' is not served",
         "input.transcription.task"),
        (TranscriptionPrompt(clip(8, 1.0), "en", prompt="hi <|en|>"), "special token", "input.transcription.prompt"),
        ("plain text", "writes audio clips down: send an Input.transcription", "input"),
        ([1, 2, 3], "writes audio clips down: send an Input.transcription", "input"),
    ],
)  # fmt: skip
def test_what_whisper_does_not_serve_is_refused_by_name(
    served: LLM, prompt: Any, message: str, param: str
) -> None:
    with pytest.raises(ValidationError, match=message) as refused:
        served.generate([prompt], GREEDY, use_tqdm=False)
    assert refused.value.param == param
    (result,) = served.generate([CASES["transcribe"]()], GREEDY, use_tqdm=False)  # (the engine serves on)
    assert len(result.choices[0].token_ids) == NEW_TOKENS


def test_a_transcription_on_another_model_is_refused(tmp_path: Path) -> None:
    from tests.families import save_family

    with engine(save_family(tmp_path / "text", "llama")) as llm, \
            pytest.raises(ValidationError, match="does not transcribe audio") as refused:  # fmt: skip
        llm.generate([CASES["transcribe"]()], GREEDY, use_tqdm=False)
    assert refused.value.param == "input.transcription"


def test_whisper_captures_no_decode_graphs(served: LLM) -> None:
    """Every Whisper step reads its rows' clips (run eagerly), so loading on CUDA records no decode graphs for it."""
    from engine_server import model_loading

    assert "Whisper decodes eagerly" in str(model_loading._eager_reason(served.core.runner.loaded))


def test_unserved_configurations_are_refused(whisper: tuple[Path, Any], tmp_path: Path) -> None:
    """Tensor parallelism, and a checkpoint stored quantized, are refused by name before anything loads."""
    import json
    import shutil

    folder, _ = whisper
    with pytest.raises(ValueError, match="Whisper is not served under tensor parallelism"):
        LLM(config=EngineConfig(model=str(folder), device="cpu", tensor_parallel_size=2))
    stored = tmp_path / "stored"
    shutil.copytree(folder, stored)
    config = json.loads((stored / "config.json").read_text())
    (stored / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ValueError, match="whisper checkpoints stored quantized \\(gptq\\) are not served"):
        LLM(config=EngineConfig(model=str(stored), device="cpu"))


def test_responses_carry_the_transcription_info(served: LLM) -> None:
    """GenerateResponse and Stream's message carry the language and the clip's seconds (convert)."""
    from engine_server.server import convert

    (result,) = served.generate([CASES["translate"]()], GREEDY, use_tqdm=False)
    response = convert.generate_response(result, "whisper")
    assert response.transcription.language == "de" and round(response.transcription.duration_seconds, 3) == 2.5
    first = convert.stream_response("r", [], "whisper", result.usage, transcription=result.transcription)
    assert first.transcription.language == "de" and not convert.stream_response("r", [], "m", result.usage).HasField(
        "transcription"
    )


def test_an_input_transcription_converts(served: LLM) -> None:
    """`Input.transcription` becomes a TranscriptionPrompt (TRANSLATE, its language, its previous text); one without
    audio is refused."""
    from engine_server.server.convert import prompt_from_input
    from ladle.v1 import types_pb2

    message = types_pb2.Input(transcription=types_pb2.Transcription(
        audio=types_pb2.Audio(data=b"RIFF"), language="de", task=types_pb2.TRANSCRIPTION_TASK_TRANSLATE, prompt="x"))
    assert prompt_from_input(message) == TranscriptionPrompt(b"RIFF", "de", "translate", "x")
    with pytest.raises(ValidationError, match="needs its audio clip"):
        prompt_from_input(types_pb2.Input(transcription=types_pb2.Transcription(language="en")))


async def test_generate_and_stream_over_grpc_detect_the_language_and_report_it(whisper: tuple[Path, Any]) -> None:
    """Over the gRPC servicer on a served engine: a Generate with no language (detected first, its one-token request
    beside) and a Stream translating, each answered with transformers' tokens and the clip's TranscriptionInfo (on
    Stream's first message alone); a text prompt is refused (INVALID_ARGUMENT naming what is served)."""
    import grpc

    from ladle.v1 import engine_pb2, types_pb2

    folder, model = whisper
    detected, translated = CASES["detected"](), CASES["translate"]()
    sampling = types_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)

    def transcription(prompt: TranscriptionPrompt, task: types_pb2.TranscriptionTask.ValueType) -> types_pb2.Input:
        return types_pb2.Input(transcription=types_pb2.Transcription(
            audio=types_pb2.Audio(data=prompt.audio), language=prompt.language, task=task))  # fmt: skip

    async with grpc_served(folder) as (stub, _):
        whole = await stub.Generate(engine_pb2.GenerateRequest(
            input=transcription(detected, types_pb2.TRANSCRIPTION_TASK_UNSPECIFIED), sampling=sampling), timeout=60)
        messages = [message async for message in stub.Stream(engine_pb2.StreamRequest(
            input=transcription(translated, types_pb2.TRANSCRIPTION_TASK_TRANSLATE), sampling=sampling),
            timeout=60)]  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Generate(engine_pb2.GenerateRequest(input=types_pb2.Input(text="hello"),
                                                           sampling=sampling), timeout=60)  # fmt: skip
    assert list(whole.choices[0].token_ids) == reference(folder, model, detected)[1]
    assert whole.transcription.language == "es" and round(whole.transcription.duration_seconds, 3) == 3.0
    assert [t for m in messages for c in m.choices for t in c.token_ids] == reference(folder, model, translated)[1]
    assert messages[0].transcription.language == "de"
    assert not any(m.HasField("transcription") for m in messages[1:])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "send an Input.transcription" in str(refused.value.details())


# A clip of 65 s (16 kHz noise and tones) with silent gaps inside the last second before each 30 s boundary: three
# windows, cut in the middle of each gap's whole 0.1 s frame (29.45 s, 58.8 s: `test_clip_windows`).
LONG_CUTS = (0, 471_200, 940_800, 1_040_000)


def long_clip() -> tuple[bytes, Any]:
    """The 65 s clip as a 16 kHz float WAV, and its samples."""
    from engine_server.multimodal.clip_windows import window_wav

    samples = heard(clip(11, 65.0))
    for start, end in ((29.4, 29.6), (58.7, 58.9)):
        samples[round(start * 16_000):round(end * 16_000)] = 0.0
    return window_wav(samples, 16_000), samples


def long_windows(whisper: tuple[Path, Any], prompt: TranscriptionPrompt) -> tuple[list[TranscriptionPrompt], Any]:
    """The long clip's windows as cut at its gaps (`LONG_CUTS`) as prompts of their own (`prompt`'s language, or the
    one transformers detects on the first window; its task and previous text on each), and transformers' prompt
    ids and tokens for each."""
    from engine_server.multimodal.clip_windows import window_wav

    folder, model = whisper
    samples = heard(prompt.audio)
    windows = [dataclasses.replace(prompt, audio=window_wav(samples[a:b], 16_000))
               for a, b in itertools.pairwise(LONG_CUTS)]  # fmt: skip
    first = reference(folder, model, windows[0])
    codes = {token: key[2:-2] for key, token in model.generation_config.lang_to_id.items()}
    language = prompt.language or codes[first[0][len(first[0]) - 3]]
    windows = [dataclasses.replace(window, language=language) for window in windows]
    return windows, [first, *(reference(folder, model, window) for window in windows[1:])]


def test_a_long_clip_is_served_as_its_windows(whisper: tuple[Path, Any], served: LLM) -> None:
    """A 65 s clip (language detected on its first window, a previous text) through LLM.generate beside a short
    clip: its three windows, cut at the quiet gaps, each get transformers' prompt (the previous text on each, the
    first window's language) and tokens on that window's samples; the result joins them (text, tokens, prompts,
    usage summed) with the whole clip's seconds; the short clip's tokens are as alone."""
    from engine_server.frontend import joined_results

    audio, _ = long_clip()
    prompt = TranscriptionPrompt(audio, prompt=PREVIOUS)
    windows, expected = long_windows(whisper, prompt)
    short = CASES["transcribe"]()
    transcription = served.inputs.transcription
    assert transcription is not None
    detections: list[bytes] = []
    detection = transcription.detection

    def spy(prompt: TranscriptionPrompt, vocab_size: int) -> Any:
        detections.append(prompt.audio)
        return detection(prompt, vocab_size)

    transcription.detection = spy  # type: ignore[method-assign]
    try:
        joined, beside = served.generate([prompt, short], GREEDY, use_tqdm=False)
    finally:
        transcription.detection = detection  # type: ignore[method-assign]
    assert detections == [windows[0].audio]  # (detected once, on the first window)
    alone = served.generate(windows, GREEDY, use_tqdm=False)
    assert [result.prompt_token_ids for result in alone] == [ids for ids, _ in expected]
    assert [result.choices[0].token_ids for result in alone] == [tokens for _, tokens in expected]
    assert joined.prompt_token_ids == [t for ids, _ in expected for t in ids]
    assert joined.choices[0].token_ids == [t for _, tokens in expected for t in tokens]
    assert joined.choices[0].text == joined_results(alone, 65.0).choices[0].text == joined_text(whisper[0], expected)
    assert joined.choices[0].text.startswith(alone[0].choices[0].text)
    assert (joined.usage.prompt_tokens, joined.usage.completion_tokens) == (
        sum(len(ids) for ids, _ in expected), 3 * NEW_TOKENS)
    assert joined.choices[0].finish_reason == "length"
    assert joined.transcription is not None and round(joined.transcription.duration_seconds, 3) == 65.0
    assert joined.transcription.language == windows[0].language
    assert beside.choices[0].token_ids == served.generate([short], GREEDY, use_tqdm=False)[0].choices[0].token_ids


def test_a_clip_over_the_cap_is_refused_by_name(whisper: tuple[Path, Any], served: LLM) -> None:
    """A clip longer than the cap (`EngineConfig.max_transcription_seconds`, an hour by default; 60 s here) is refused
    with its length; a cap of 0 is refused at the start."""
    transcription = served.inputs.transcription
    assert transcription is not None and transcription.max_clip_seconds == 3600.0
    config = EngineConfig(model=str(whisper[0]), device="cpu", quantization="none", max_transcription_seconds=60.0,
                          cache=CacheConfig(memory_bytes=64 * 1024**2))  # fmt: skip
    with LLM(config=config) as llm, pytest.raises(ValidationError, match=r"65\.0 s long; this model hears at most "
                                                  r"60 s") as refused:  # fmt: skip
        llm.generate([TranscriptionPrompt(long_clip()[0], "en")], GREEDY, use_tqdm=False)
    assert refused.value.param == "input.transcription.audio"
    with pytest.raises(ValueError, match="--max-transcription-seconds must be > 0"):
        EngineConfig(model=str(whisper[0]), max_transcription_seconds=0.0)


async def test_a_long_clip_over_grpc_generate_and_stream(whisper: tuple[Path, Any]) -> None:
    """The 65 s clip over the servicer: Generate (language detected on the first window) answers the windows'
    transformers tokens joined, their usage summed and the whole clip's seconds; Stream (German, a previous text)
    streams window 0's tokens, then window 1's, then window 2's, their texts joined as the whole text."""
    from ladle.v1 import engine_pb2, types_pb2

    folder, _ = whisper
    audio, _ = long_clip()
    detected = TranscriptionPrompt(audio)
    german = TranscriptionPrompt(audio, "de", prompt=PREVIOUS)
    detected_windows, detected_expected = long_windows(whisper, detected)
    _, german_expected = long_windows(whisper, german)
    sampling = types_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)

    def transcription(prompt: TranscriptionPrompt) -> types_pb2.Input:
        return types_pb2.Input(transcription=types_pb2.Transcription(
            audio=types_pb2.Audio(data=prompt.audio), language=prompt.language, prompt=prompt.prompt))  # fmt: skip

    # One sequence at a time: when the caller closes after window 0's first update, windows 1 and 2 are still waiting
    # however slowly the test's event loop runs (running beside it, they could finish first on a loaded machine).
    async with grpc_served(folder, max_num_seqs=1) as (stub, engine):
        whole = await stub.Generate(engine_pb2.GenerateRequest(input=transcription(detected), sampling=sampling),
                                    timeout=120)  # fmt: skip
        messages = [message async for message in stub.Stream(engine_pb2.StreamRequest(
            input=transcription(german), sampling=sampling), timeout=120)]  # fmt: skip
        aborted = await cancelled_after_the_first_update(engine, TranscriptionPrompt(audio, "en"))
        for _ in range(200):  # (the aborted streams let go)
            if not engine.loop._streams:
                break
            await asyncio.sleep(0.01)
        left = dict(engine.loop._streams)
    assert list(whole.choices[0].token_ids) == [t for _, tokens in detected_expected for t in tokens]
    assert whole.usage.prompt_tokens == sum(len(ids) for ids, _ in detected_expected)
    assert whole.usage.completion_tokens == 3 * NEW_TOKENS
    assert whole.transcription.language == detected_windows[0].language
    assert round(whole.transcription.duration_seconds, 3) == 65.0
    assert [t for m in messages for c in m.choices for t in c.token_ids] == [
        t for _, tokens in german_expected for t in tokens]
    assert messages[0].transcription.language == "de" and round(messages[0].transcription.duration_seconds) == 65
    assert "".join(c.text for m in messages for c in m.choices) == joined_text(folder, german_expected)
    assert whole.choices[0].text == joined_text(folder, detected_expected)
    # Closing early aborts every window the core holds (window 0, running, and those queued behind it; a window whose
    # task had not reached the core yet, on a loaded machine, is cancelled before it does) and leaves none running.
    assert 1 <= len({core_id.rpartition("/")[0] for core_id in aborted}) <= 3 and not left


async def cancelled_after_the_first_update(engine: Any, prompt: TranscriptionPrompt) -> list[str]:
    """The core ids `engine` aborts when a long clip's generate (windows running long: ignore_eos) is closed after
    its first update."""
    import contextlib

    from engine_server.server.serving import GenerationInput

    aborted: list[str] = []
    abort = engine.loop.abort

    def spy(ids: list[str]) -> None:
        aborted.extend(ids)
        abort(ids)

    engine.loop.abort = spy
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    async with contextlib.aclosing(engine.generate(GenerationInput("c", prompt, params))) as updates:
        async for update in updates:
            assert not update.finished
            break
    engine.loop.abort = abort
    return aborted


def joined_text(folder: Path, expected: list[tuple[list[int], list[int]]]) -> str:
    """The windows' texts (their tokens decoded, special tokens skipped) joined as `frontend.window_separator` joins
    them (a space where neither side has one)."""
    from transformers import AutoTokenizer

    from engine_server.frontend import window_separator

    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = ""
    for _, tokens in expected:
        part = tokenizer.decode(tokens, skip_special_tokens=True)
        text += window_separator(text, part) + part
    return text
