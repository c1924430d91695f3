"""Cache-aware routing: which SERVING engine a call goes to.

Each engine keeps the KV blocks of prompts it served in its prefix cache, so a request whose leading tokens an
engine has already seen prefills only the rest there. The gateway cannot look into those caches; it keeps an
approximate record of them instead. A request's input, as bytes in the order the model reads it (tools, then
each message; or the prompt text or ids), is cut into `CHUNK_BYTES` chunks, and each chunk's hash is chained
with the hash before it (as the engine chains its block hashes), so the k-th hash stands for the whole first k
chunks. Each engine remembers the hashes of what it was sent, least recently used forgotten first, about as
much as its KV cache holds. The chain starts from the request's `cache_salt` (the engine's prefix-cache namespace,
one per project) and its LoRA adapter, as the engine's does: requests of one project (and adapter) find each
other's prefixes, and a prefix never draws another project's requests to an engine where they could not hit it.
Only engines that hold a request's adapter are candidates (`gateway.engines.EnginePool.eligible`).

The choice (`Router.choose`): the engine that holds the longest run of the request's leading hashes, at least
`min_match_chunks` of them — unless its load is clearly above the least loaded engine's (more than
`balance_abs` sequences above it and more than `balance_rel` times it); otherwise, and for a request too short
to share a chunk, the least loaded engine, round robin between equals. `least_busy` routing skips the record.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from ladle.v1 import types_pb2

CHUNK_BYTES = 256  # about 64 tokens of English text: four KV blocks of 16
BYTES_PER_TOKEN = 4  # to size an engine's record from its KV cache (tokens) in chunks (bytes)
DEFAULT_RECORD_CHUNKS = 16_384  # until the engine's KV cache size is known (4 MiB of prompt text)

Policy = Literal["cache_aware", "least_busy"]
Reason = Literal["prefix", "least_busy"]


@dataclass(frozen=True)
class RoutingConfig:
    """How calls are spread: `policy`, and when a prefix match yields to load (see the module docstring)."""

    policy: Policy = "cache_aware"
    min_match_chunks: int = 1
    balance_abs: int = 8
    balance_rel: float = 1.5

    def __post_init__(self) -> None:
        if self.min_match_chunks < 1 or self.balance_abs < 0 or self.balance_rel < 1:
            raise ValueError("min_match_chunks must be >= 1, balance_abs >= 0 and balance_rel >= 1")


def input_bytes(value: types_pb2.Input) -> bytes:
    """The input as the bytes routing hashes: equal for inputs the model reads identically, and a request
    that extends another (more messages, a longer prompt) extends its bytes; a chat turn's images and audio clips, and
    a transcription's clip, are their `clip_key`s (a transcription's then its task, language and prompt)."""
    kind = value.WhichOneof("kind")
    if kind == "text":
        return value.text.encode()
    if kind == "token_ids":
        return b"".join(token.to_bytes(4, "little") for token in value.token_ids.ids)
    if kind == "chat":
        parts = [tool.SerializeToString(deterministic=True) for tool in value.chat.tools]
        parts += [_with_media_keys(message).SerializeToString(deterministic=True) for message in value.chat.messages]
        return b"".join(parts)
    if kind == "transcription":
        speech = value.transcription
        return clip_key(speech.audio.data) + f"\0{speech.task}\0{speech.language}\0{speech.prompt}".encode()
    return b""


def _with_media_keys(message: types_pb2.ChatMessage) -> types_pb2.ChatMessage:
    """`message` with each image's and audio clip's bytes replaced by their `clip_key` (the message itself where it
    has none): a 20 MiB image costs one hash in an engine's record, and the same image still finds it."""
    if not any(part.HasField("image") or part.HasField("audio") for part in message.content_parts):
        return message
    keyed = types_pb2.ChatMessage()
    keyed.CopyFrom(message)
    for part in keyed.content_parts:
        media = part.image if part.HasField("image") else part.audio if part.HasField("audio") else None
        if media is not None:
            media.data = clip_key(media.data)
    return keyed


def clip_key(data: bytes) -> bytes:
    """An audio clip or an image as one whole chunk of routing bytes: a digest of it, repeated to CHUNK_BYTES. The
    same clip finds the engine that heard it, and a 25 MiB clip costs one hash in an engine's record, not 100,000."""
    digest = hashlib.blake2b(data, digest_size=64).digest()
    return digest * (CHUNK_BYTES // len(digest))


def prefix_hashes(data: bytes, chunk_bytes: int = CHUNK_BYTES, cache_salt: str = "", adapter: str = "") -> list[bytes]:
    """One chained hash per whole chunk of `data` (a trailing partial chunk has none), the chain started from
    `cache_salt` and the LoRA `adapter` (both empty: the unsalted chain). The engine keys its blocks by adapter
    too, so a prefix one adapter's calls left on an engine draws only that adapter's calls."""
    hashes: list[bytes] = []
    seed = b"cache_salt\0" + cache_salt.encode() if cache_salt else b""
    if adapter:
        seed += b"\0adapter\0" + adapter.encode()
    previous = hashlib.blake2b(seed, digest_size=16).digest() if seed else b""
    for start in range(0, len(data) - chunk_bytes + 1, chunk_bytes):
        previous = hashlib.blake2b(previous + data[start:start + chunk_bytes], digest_size=16).digest()
        hashes.append(previous)
    return hashes


class PrefixRecord:
    """The prefix hashes one engine was sent, least recently used forgotten first beyond `capacity`."""

    def __init__(self, capacity: int = DEFAULT_RECORD_CHUNKS) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`' leading entries this engine holds."""
        count = 0
        for digest in hashes:
            if digest not in self._hashes:
                break
            count += 1
        return count

    def add(self, hashes: Sequence[bytes]) -> None:
        """Record `hashes` as just used. The first is touched last, so a long prompt's tail is forgotten
        before its head, as the engine's cache frees a sequence's blocks from its end."""
        for digest in reversed(hashes):
            self._hashes[digest] = None
            self._hashes.move_to_end(digest)
        self.trim()

    def trim(self) -> None:
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        self._hashes.clear()


class Candidate(Protocol):
    """What routing needs of an engine."""

    @property
    def busy(self) -> int: ...

    @property
    def record(self) -> PrefixRecord: ...


@dataclass(frozen=True)
class Choice:
    index: int  # into the candidates given
    reason: Reason
    matched_chunks: int


class Router:
    """Chooses among SERVING engines per `RoutingConfig`; remembers what each was sent."""

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[Candidate], hashes: Sequence[bytes]) -> Choice:
        """The engine for a request whose input has `hashes`; `candidates` must not be empty. The choice is
        recorded: the chosen engine's record gains `hashes`."""
        if not candidates:
            raise ValueError("no candidate engines")
        turn = next(self._turn)
        count = len(candidates)
        least = min(range(count), key=lambda i: (candidates[i].busy, (i - turn) % count))
        choice = Choice(least, "least_busy", 0)
        if self.config.policy == "cache_aware" and hashes:
            matches = [c.record.match(hashes) for c in candidates]
            best = max(range(count), key=lambda i: (matches[i], -candidates[i].busy, -((i - turn) % count)))
            if matches[best] >= self.config.min_match_chunks and not self._overloaded(
                    candidates[best].busy, candidates[least].busy):
                choice = Choice(best, "prefix", matches[best])
        if hashes:
            candidates[choice.index].record.add(hashes)
        return choice

    def _overloaded(self, busy: int, least_busy: int) -> bool:
        return busy > least_busy + self.config.balance_abs and busy > least_busy * self.config.balance_rel
