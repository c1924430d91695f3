"""Batched, on-device token sampling: the Sampler and the per-row inputs and outputs it trades in."""

from engine_server.sampling.metadata import SamplingMetadata, SamplingRow
from engine_server.sampling.sampler import Sampler, SamplerOutput, TokenLogprobs

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "SamplingRow", "TokenLogprobs"]
