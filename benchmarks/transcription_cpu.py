"""Speech to text on the CPU: a random Whisper checkpoint of whisper-base's shape (512 wide, 6 encoder and 6 decoder
layers, 8 heads; the embedded tokenizer's 49k tokens with Whisper's special tokens added) transcribing 10-second clips,
served by the engine on the float path and on its int8 default, and by transformers' own `generate` in the same run:
one clip (64 new tokens) start to end and to its first token, and 8 clips at once (the engine batches them, and
transformers' `generate` takes them as one batch too: Whisper's features are all one window long). The
float path's greedy tokens must equal transformers' (the script fails otherwise). Whisper's encoder always reads its
30-second window, and it is transformers' float module on every path, so the first token is no faster.
With `--timestamps` the vocabulary has Whisper's 1,501 timestamp tokens and every decode keeps to its timestamp rules:
the engine's `Transcription.timestamps`, and transformers' one decode under its `WhisperTimeStampLogitsProcessor`
(`GenerationMixin.generate` from the same prompt: Whisper's own `generate` would decode again from the last timestamp).
With `--words` every decode times its words (the engine's `Transcription.word_timestamps`; transformers' `generate`
with `return_token_timestamps` and the clips' attention masks), over the checkpoint's `ALIGNMENT_HEADS`.

    PYTHONPATH=. .venv/bin/python -m benchmarks.transcription_cpu --out benchmarks/results/transcription_cpu.jsonl
    PYTHONPATH=. .venv/bin/python -m benchmarks.transcription_cpu --timestamps \
        --out benchmarks/results/transcription_cpu.jsonl
    PYTHONPATH=. .venv/bin/python -m benchmarks.transcription_cpu --words \
        --out benchmarks/results/transcription_cpu.jsonl
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import media_input
from benchmarks.audio_input_cpu import RATE, SECONDS, recording  # (its 10-second clips)
from benchmarks.common import append_result
from benchmarks.vl_checkpoints import save_drawn, vision_tokenizer

NEW = 64
SHAPE: dict[str, Any] = {"d_model": 512, "encoder_layers": 6, "decoder_layers": 6, "encoder_attention_heads": 8,
         "decoder_attention_heads": 8, "encoder_ffn_dim": 2048, "decoder_ffn_dim": 2048, "num_mel_bins": 80,
         "max_source_positions": 1500, "max_target_positions": 448}  # fmt: skip
LANGUAGES = ("en", "de", "fr", "es")
SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", *[f"<|{code}|>" for code in LANGUAGES], "<|translate|>",
            "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]  # fmt: skip


TIMESTAMPS = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]  # <|0.00|> to <|30.00|>, after <|notimestamps|>
ALIGNMENT_HEADS = [[3, 1], [4, 2], [5, 3], [5, 6]]  # (layer, head): a random checkpoint's, for word timings


def save_checkpoint(folder: Path, timestamps: bool = False) -> Any:
    """The benchmark's random Whisper checkpoint in `folder`, with its feature extractor and generation config (and
    Whisper's timestamp tokens, where `timestamps`)."""
    import transformers

    tokenizer = vision_tokenizer(folder, SPECIALS, "")
    if timestamps:
        tokenizer.add_tokens(TIMESTAMPS)
        tokenizer.save_pretrained(folder)
    ids = {token: int(tokenizer.convert_tokens_to_ids(token)) for token in SPECIALS}
    eos, start = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    config = transformers.WhisperConfig(**SHAPE, vocab_size=len(tokenizer), decoder_start_token_id=start,
                                        eos_token_id=eos, pad_token_id=eos, bos_token_id=eos)  # fmt: skip
    model = save_drawn(folder, transformers.WhisperForConditionalGeneration, config, lambda name: False, (0.05, 0.05))
    generation = transformers.GenerationConfig(
        decoder_start_token_id=start, eos_token_id=eos, pad_token_id=eos, bos_token_id=eos,
        lang_to_id={f"<|{code}|>": ids[f"<|{code}|>"] for code in LANGUAGES},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"], prev_sot_token_id=ids["<|startofprev|>"],
        is_multilingual=True, suppress_tokens=[], begin_suppress_tokens=[eos], max_length=448,
        max_initial_timestamp_index=50, alignment_heads=ALIGNMENT_HEADS,
    )  # fmt: skip
    generation.save_pretrained(folder)
    model.generation_config = generation
    transformers.WhisperFeatureExtractor(feature_size=80).save_pretrained(folder)
    return model


def transformers_run(
    model: Any, folder: Path, clips: list[bytes], timestamps: bool = False, words: bool = False
) -> dict[str, Any]:
    """transformers' timings over `clips` (`media_input.transformers_run`); with `timestamps`, one decode each under
    Whisper's timestamp processor; with `words`, its token timestamps too."""
    import numpy as np
    import soundfile
    import torch
    from transformers import GenerationMixin, LogitsProcessorList, WhisperFeatureExtractor
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    extractor = WhisperFeatureExtractor.from_pretrained(folder)
    generation = model.generation_config
    prompt = [generation.decoder_start_token_id, generation.lang_to_id["<|en|>"], generation.task_to_id["transcribe"]]

    def generate_all(batch: Sequence[bytes], new: int) -> list[list[int]]:
        samples = [np.asarray(soundfile.read(io.BytesIO(clip), dtype="float32")[0]) for clip in batch]
        found = extractor(samples, sampling_rate=RATE, return_tensors="pt", return_attention_mask=True)
        features = found.input_features
        with torch.inference_mode():
            if not timestamps:
                out = model.generate(features, attention_mask=found.attention_mask, language="en", task="transcribe",
                                     max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                     return_token_timestamps=words)  # fmt: skip
                return [[int(t) for t in row] for row in (out["sequences"] if words else out)]
            rules = LogitsProcessorList([WhisperTimeStampLogitsProcessor(generation, len(prompt))])
            out = GenerationMixin.generate(model, input_features=features, decoder_input_ids=torch.tensor(
                [prompt] * len(batch)), logits_processor=rules, max_new_tokens=new, min_new_tokens=new,
                do_sample=False)  # fmt: skip
        return [[int(t) for t in row[len(prompt):]] for row in out]

    def generate(clip: bytes, new: int) -> list[int]:
        return generate_all([clip], new)[0]

    return media_input.transformers_run(generate, clips, recording(99), NEW, generate_all)


def main(argv: list[str] | None = None) -> int:
    from engine_server.multimodal.transcription import TranscriptionPrompt

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8, help="clips at once")
    parser.add_argument("--timestamps", action="store_true", help="decode with Whisper's timestamp tokens")
    parser.add_argument("--words", action="store_true", help="time every decode's words")
    parser.add_argument("--out", type=Path, help="append the results to this JSONL file")
    args = parser.parse_args(argv)
    if args.timestamps and args.words:
        parser.error("--timestamps and --words are measured apart")
    command = "python -m benchmarks.transcription_cpu" + (" --timestamps" if args.timestamps else "") + (
        " --words" if args.words else "") + (f" --out {args.out}" if args.out else "")
    clips = [recording(seed) for seed in range(args.requests)]
    with tempfile.TemporaryDirectory() as root:
        folder = Path(root) / "whisper"
        model = save_checkpoint(folder, args.timestamps)
        model.eval()
        peer = transformers_run(model, folder, clips, args.timestamps, args.words)
        prompts = [TranscriptionPrompt(clip, "en", timestamps=args.timestamps, word_timestamps=args.words)
                   for clip in clips]  # fmt: skip
        warm = TranscriptionPrompt(recording(99), "en", timestamps=args.timestamps, word_timestamps=args.words)
        runs = media_input.compared_runs(folder, peer, prompts, warm, NEW, max_model_len=SHAPE["max_target_positions"])
    if runs is None:
        return 1
    result = media_input.result_record(
        "transcription_cpu", command, runs, args.requests, NEW, model="whisper", shape=SHAPE, weights="random",
        clip_seconds=SECONDS, timestamps=args.timestamps, words=args.words,
    )  # fmt: skip
    print(result)
    if args.out:
        append_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
