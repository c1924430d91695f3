"""Output processing: incremental detokenization, stop strings and logprob token text, per choice."""

from engine_server.output.detokenizer import IncrementalDetokenizer
from engine_server.output.processor import OutputProcessor
from engine_server.output.stop_strings import StopStringMatcher
from engine_server.output.token_text import TokenTextCodec, token_bytes, token_strings
from engine_server.output.types import ChoiceDelta, FinishReason

__all__ = [
    "ChoiceDelta",
    "FinishReason",
    "IncrementalDetokenizer",
    "OutputProcessor",
    "StopStringMatcher",
    "TokenTextCodec",
    "token_bytes",
    "token_strings",
]
