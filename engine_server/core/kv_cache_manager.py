"""Paged KV cache bookkeeping: per-request block tables and prefix caching by chained block hashes.

Block i of a request holds the K/V of token positions `[i * block_size, (i + 1) * block_size)`. A full
block is identified by `sha256(hash(block i-1) || token ids of block i)`, so equal hashes mean equal
whole prefixes, not just equal blocks. sha256 rather than Python's `hash()`: a 64-bit non-cryptographic
hash can be collided on purpose, and a collision makes one request attend to another's K/V (wrong output,
and a cross-tenant leak). With 256 bits we treat collisions as impossible and do not compare token ids.

The chain starts at a root that is a function of the request's `cache_salt` (`root_hash`): the empty root for no
salt (the hashes ladle always had), else a digest of the salt. Requests with different salts therefore never
share a block, even for equal tokens, and a tenant cannot learn from cache hits (cached_prompt_tokens, a faster
first token) what another tenant sent; requests with equal salts share as before.

Hashes are registered when a block becomes full *at allocation time*, for the tokens being scheduled.
A second request scheduled later in the same step can therefore share blocks the first one is only
about to write: the runner writes all K/V of a step before any attention reads it. Only tokens whose ids
are known at schedule time (prompt and already sampled outputs) are ever hashed. The partial last block
of a request is never shared.

A step that is scheduled but stopped before it runs (engine_server.step_interrupt) takes its publications back
with `undo_publications`: the manager records, from one `begin_step` to the next, the blocks it registered and
each request's settled count before the step.

With a sliding `window` (a model whose every layer attends to the last `window` positions only), a request gives
its leading blocks back to the pool once no token it has yet to compute can see them: whenever it takes a new
block, the blocks wholly before `num_computed_tokens - window + 1`, less one block kept as a margin (a speculative
rollback or a step still in flight moves that bound back by less than a block), are freed, and their places in its
table hold `num_blocks`, the scratch block the KV cache keeps beyond the pool (zeros; the kernels read no position
before a window, and the torch reference masks what it gathers). A pure-window request then holds about
window / block_size + 2 blocks however long it runs. A released block that was published stays a cached free
block, so a prefix-cache hit still finds it until it is evicted.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

from engine_server.core.block_pool import BlockPool
from engine_server.core.request import Request

_ROOT_HASH = b""  # the root of an unsalted chain
_SALT_DOMAIN = b"ladle.v1 cache_salt\0"  # keeps a salted root apart from any block's hash input
_ADAPTER_DOMAIN = b"ladle.v1 cache_salt+adapter\0"  # and an adapter's root apart from a salt's
_IMAGES_DOMAIN = b"ladle.v1 images root\0"  # and a root with images apart from both


def root_hash(cache_salt: str, adapter_key: str = "") -> bytes:
    """The parent of a request's first block: empty without a salt or adapter (today's hashes exactly), else a
    sha256 of the salt (and of the LoRA adapter's key, `LoraAdapter.key`, when there is one), which equals no
    block's hash (that would take a sha256 collision), so a chain never meets one of another salt or adapter."""
    if not cache_salt and not adapter_key:
        return _ROOT_HASH
    salt = cache_salt.encode("utf-8", "surrogatepass")
    if not adapter_key:
        return hashlib.sha256(_SALT_DOMAIN + salt).digest()
    key = adapter_key.encode("utf-8", "surrogatepass")
    return hashlib.sha256(_ADAPTER_DOMAIN + len(salt).to_bytes(8, "little") + salt + key).digest()


def request_root(request: Request) -> bytes:
    """`root_hash` of a request's salt and adapter; for a prompt with images, a sha256 of that and of its images'
    digest (`MultimodalInputs.digest`): the images' placeholder ids are equal whatever the images, so a chain starts
    apart for other images (blocks before the first image too: they are shared only with the same images)."""
    root = root_hash(request.cache_salt, "" if request.lora is None else request.lora.key)
    if request.multimodal is None:
        return root
    return hashlib.sha256(_IMAGES_DOMAIN + root + request.multimodal.digest).digest()


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: depends on the block's tokens and every block before it."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


class KVCacheManager:
    """Hands out KV blocks to requests. Owned by the scheduler; not thread-safe.

    Contract with the scheduler: for a request's first allocation after (re)admission it calls
    `get_computed_blocks` and passes the result to `allocate_slots` while `request.num_computed_tokens`
    still excludes the cached tokens; it then advances `num_computed_tokens` itself.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int = 0
    ) -> None:
        """`window` > 0: release blocks outside it (module docstring); 0: a request keeps every block it takes."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.released_block = num_blocks  # what a released block's place in a table holds: the scratch block
        # Per request: how many leading blocks of its table it has released (window > 0 only).
        self._num_released: dict[str, int] = {}
        self._pack_block = struct.Struct(f"{block_size}q").pack  # a block's token ids as `hash_block` reads them
        self._pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        # Per request: how many leading blocks of its table are already settled for hashing
        # (registered, a cache hit, or a duplicate left private). Keeps hashing O(new blocks) per step.
        self._num_settled: dict[str, int] = {}
        # Since `begin_step`: the blocks registered under a hash, and each request's settled count before its first
        # change (with the request, to recompute its in-place bound): what `undo_publications` takes back.
        self._step_registered: list[int] = []
        self._step_settled: dict[str, tuple[Request, int]] = {}

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self._pool.num_blocks - self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (free cached blocks count as unused)."""
        return self.num_used_blocks / self._pool.num_blocks

    @property
    def pool(self) -> BlockPool:
        """The underlying pool, for inspection (ref counts, hashes) in tests and metrics."""
        return self._pool

    def block_table(self, request_id: str) -> list[int]:
        """The request's live block table (empty if it holds none). Read-only for callers.

        Later allocations append; an entry otherwise changes only when a sliding window releases its block, which
        no token still to be computed reads (it then holds `released_block`).
        """
        return self._tables.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached full blocks matching the start of `request.all_token_ids`, and the tokens they cover.

        Never covers every token: at least one must be computed so the step yields logits to sample.
        Does not take references; `allocate_slots` does, so call it before anything else allocates.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = max(0, (request.num_tokens - 1) // self.block_size)
        self._hash_full_blocks(request, max_blocks)
        blocks: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self._pool.lookup(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

    def prefix_hash(self, request: Request, num_blocks: int) -> bytes:
        """The chained hash of `request`'s first `num_blocks` (> 0) full blocks (`hash_block`'s of the last)."""
        self._hash_full_blocks(request, num_blocks)
        return request.block_hashes[num_blocks - 1]

    def slots_in_place(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """The request's block table when `num_new_tokens` more fit in the blocks it holds and fill none of
        them (nothing to allocate or publish), else None: then call `allocate_slots`. Changes nothing.

        The scheduler asks this first for every running request every step; a decode inside its last block,
        most of them, ends here in a few operations.
        """
        num_total = request.num_computed_tokens + num_new_tokens
        if num_total <= request.num_slots_in_place:
            return request.block_ids
        table = self._tables.get(request.request_id)
        if table is None:
            return None
        size = self.block_size
        if num_total > len(table) * size:
            return None
        if self.enable_prefix_caching and min(num_total, request.num_tokens) // size > self._num_settled.get(
            request.request_id, 0
        ):
            return None
        return table

    def slot_for_one(self, request: Request) -> list[int] | None:
        """`slots_in_place(request, 1)`, else `allocate_slots(request, 1)`: room for a decode's one token, in one
        call. The scheduler's path for the decodes that fill their last block (publishing it) or start a new one,
        a 1/block_size share of every step's decodes; None when no block is free (nothing changed)."""
        table = self._tables.get(request.request_id)
        if table is None:
            return self.allocate_slots(request, 1)
        size = self.block_size
        num_total = request.num_computed_tokens + 1
        if num_total > len(table) * size:
            block_id = self._pool.allocate_one()
            if block_id is None:
                return None
            table.append(block_id)
            if self.window:
                self._release_outside_window(request, table)
        if self.enable_prefix_caching:
            self._publish_full_blocks(request, table, min(num_total, len(request.all_token_ids)) // size)
        self._note_in_place(request, table)
        return table

    def slots_for_decodes(self, requests: Sequence[Request]) -> int:
        """`slot_for_one` for each request in order (decodes that fill their last block or start a new one); stops
        at the first that finds no free block (unchanged) and returns how many it served before it."""
        size, tables, pool, settled = self.block_size, self._tables, self._pool, self._num_settled
        caching, pack, sha256 = self.enable_prefix_caching, self._pack_block, hashlib.sha256
        step_settled, registered = self._step_settled, self._step_registered
        for served, request in enumerate(requests):
            request_id = request.request_id
            table = tables.get(request_id)
            if table is None:
                if self.allocate_slots(request, 1) is None:
                    return served
                continue
            num_total = request.num_computed_tokens + 1
            if num_total > len(table) * size:
                block_id = pool.allocate_one()
                if block_id is None:
                    return served
                table.append(block_id)
                if self.window:
                    self._release_outside_window(request, table)
            capacity = len(table) * size
            if caching:
                tokens = request.all_token_ids
                num_full = min(num_total, len(tokens)) // size
                done = settled.get(request_id, 0)
                if num_full > done:
                    hashes = request.block_hashes
                    if num_full == done + 1 == len(hashes) + 1:
                        # The usual case, `_publish_full_blocks` inline: the one block this decode filled.
                        parent = hashes[-1] if hashes else request_root(request)
                        block_hash = sha256(parent + pack(*tokens[done * size : num_full * size])).digest()
                        hashes.append(block_hash)
                        if pool.register(table[done], block_hash):
                            registered.append(table[done])
                        if request_id not in step_settled:
                            step_settled[request_id] = (request, done)
                        settled[request_id] = done = num_full
                    else:
                        self._publish_full_blocks(request, table, num_full)
                        done = settled[request_id]
                capacity = min(capacity, (done + 1) * size - 1)  # `_note_in_place`, inline
            request.block_ids, request.num_slots_in_place = table, capacity
        return len(requests)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Make room for `num_new_tokens` after the computed ones; None if too few blocks are free.

        `new_computed_blocks` are cache hits from `get_computed_blocks` (only on a first allocation).
        On success returns the request's full block table and publishes the hashes of blocks this
        step fills. On failure nothing changes.
        """
        size = self.block_size
        table = self._tables.get(request.request_id)
        if table is None:
            table = self._tables[request.request_id] = []
        num_total = request.num_computed_tokens + len(new_computed_blocks) * size + num_new_tokens
        num_needed = -(-num_total // size) - len(table) - len(new_computed_blocks)
        # A decode inside its last block skips this: it is most calls, every step.
        if num_needed > 0 or new_computed_blocks:
            # Free cached hits are counted in num_free_blocks; touching them removes them from it.
            num_revived = sum(1 for b in new_computed_blocks if self._pool.ref_count(b) == 0)
            if max(num_needed, 0) + num_revived > self._pool.num_free_blocks:
                if not table:
                    del self._tables[request.request_id]
                return None
            if new_computed_blocks:
                self._pool.touch(new_computed_blocks)
                table.extend(new_computed_blocks)
                self._settle(request, len(table))
            if num_needed > 0:
                table.extend(self._pool.allocate(num_needed))
                if self.window:
                    self._release_outside_window(request, table)
        if self.enable_prefix_caching:
            self._publish_full_blocks(request, table, min(num_total, request.num_tokens) // size)
        self._note_in_place(request, table)
        return table

    def begin_step(self) -> None:
        """Start a step's record of publications (the scheduler calls it as each step's scheduling begins)."""
        self._step_registered.clear()
        self._step_settled.clear()

    def undo_publications(self) -> None:
        """Unpublish every block registered since `begin_step` and return the requests that still hold blocks to
        their settled counts from before it: the step that filled them never ran, so no cache hit may find them,
        and its rerun publishes them again. Call it after freeing the requests the step admitted."""
        for block_id in reversed(self._step_registered):
            self._pool.unregister(block_id)
        for request_id, (request, settled) in self._step_settled.items():
            table = self._tables.get(request_id)
            if table is not None:
                self._num_settled[request_id] = settled
                self._note_in_place(request, table)
        self.begin_step()

    def free(self, request: Request) -> None:
        """Release every block of the request. Cached blocks stay reusable until evicted."""
        table = self._tables.pop(request.request_id, None)
        self._num_settled.pop(request.request_id, None)
        released = self._num_released.pop(request.request_id, 0)
        request.block_ids, request.num_slots_in_place = [], 0
        if table:
            # Tail first: a request's last blocks are evicted before its first ones, so the shared
            # head of a prefix chain outlives the tail that depends on it.
            self._pool.free(reversed(table[released:]))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after weights change). Running requests keep their blocks."""
        self._pool.reset_cache()
        for request_id, table in self._tables.items():
            self._num_settled[request_id] = len(table)

    def _note_in_place(self, request: Request, table: list[int]) -> None:
        """Record on the request its live table and the bound below which `slots_in_place` holds at once: the
        slots of the blocks it holds, short of filling the first block not yet settled (which must be published).
        A later `reset_prefix_cache` only settles more blocks, so a recorded bound never overstates."""
        capacity = len(table) * self.block_size
        if self.enable_prefix_caching:
            capacity = min(capacity, (self._num_settled.get(request.request_id, 0) + 1) * self.block_size - 1)
        request.block_ids, request.num_slots_in_place = table, capacity

    def _release_outside_window(self, request: Request, table: list[int]) -> None:
        """Free the leading blocks of `table` that no token from `request.num_computed_tokens` on can see through
        the window, but one (module docstring), putting `released_block` in their places."""
        request_id = request.request_id
        done = self._num_released.get(request_id, 0)
        dead = min(len(table), (request.num_computed_tokens - self.window + 1) // self.block_size - 1)
        if dead <= done:
            return
        freed = table[done:dead]
        table[done:dead] = [self.released_block] * (dead - done)
        self._pool.free(reversed(freed))
        self._num_released[request_id] = dead

    def _hash_full_blocks(self, request: Request, num_blocks: int) -> None:
        """Extend `request.block_hashes` to cover its first `num_blocks` full blocks."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        size, pack, sha256 = self.block_size, self._pack_block, hashlib.sha256
        parent = hashes[-1] if hashes else request_root(request)
        for i in range(len(hashes), num_blocks):
            parent = sha256(parent + pack(*tokens[i * size : (i + 1) * size])).digest()  # hash_block, inline
            hashes.append(parent)

    def _publish_full_blocks(self, request: Request, table: list[int], num_full: int) -> None:
        settled = self._num_settled.get(request.request_id, 0)
        if num_full <= settled:
            return
        self._hash_full_blocks(request, num_full)
        for i in range(settled, num_full):
            if self._pool.register(table[i], request.block_hashes[i]):
                self._step_registered.append(table[i])
        self._settle(request, num_full)

    def _settle(self, request: Request, num_settled: int) -> None:
        """Set the request's settled count, recording the one before this step's first change."""
        request_id = request.request_id
        if request_id not in self._step_settled:
            self._step_settled[request_id] = (request, self._num_settled.get(request_id, 0))
        self._num_settled[request_id] = num_settled
