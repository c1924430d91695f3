"""The pool of KV blocks: reference counts, the hash -> block map, and LRU eviction of free cached blocks.

A block is *free* when no request references it (ref count 0). A free block may still hold a cached
prefix (it has a hash); it stays reusable by a cache hit until it is handed out for new data, which
evicts it. Allocation takes never-cached free blocks first and evicts cached ones only when those run
out, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    """Owns every block id in `range(num_blocks)`. Not thread-safe: the engine step loop is its only user."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_cnt = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        # Free blocks without a hash: any order will do; a list used as a stack is the cheapest.
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks with a hash, least recently freed first (the eviction order).
        self._free_cached: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` can hand out, counting free cached blocks it would evict."""
        return len(self._free_plain) + len(self._free_cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        return self._hash[block_id]

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding this hash, in use or free, or None."""
        return self._cached.get(block_hash)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (ref count becomes 1), evicting cached ones if needed.

        The caller checks `num_free_blocks` first; asking for more raises ValueError.
        """
        if count > self.num_free_blocks:
            raise ValueError(f"asked for {count} blocks, {self.num_free_blocks} free")
        out: list[int] = []
        while len(out) < count:
            if self._free_plain:
                block_id = self._free_plain.pop()
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                self._forget(block_id)
            self._ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def allocate_one(self) -> int | None:
        """`allocate(1)[0]`, or None (nothing changed) when no block is free: a decode's path into a new block."""
        if self._free_plain:
            block_id = self._free_plain.pop()
        elif self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)
            self._forget(block_id)
        else:
            return None
        self._ref_cnt[block_id] = 1
        return block_id

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to blocks found by a cache hit, taking free ones off the eviction queue."""
        for block_id in block_ids:
            if self._ref_cnt[block_id] == 0:
                del self._free_cached[block_id]
            self._ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 become free in the order given."""
        for block_id in block_ids:
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                if self._hash[block_id] is None:
                    self._free_plain.append(block_id)
                else:
                    self._free_cached[block_id] = None

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Publish a full block under its hash. False (and no change) if another block already holds it.

        A duplicate arises when two requests compute the same block before either is published; the
        second copy simply stays private to its request.
        """
        if block_hash in self._cached or self._hash[block_id] is not None:
            return False
        self._cached[block_hash] = block_id
        self._hash[block_id] = block_hash
        return True

    def unregister(self, block_id: int) -> None:
        """Take back a block's hash, published for data that was never written (a step stopped before it ran:
        `KVCacheManager.undo_publications`). A free block becomes a plain free one; no hash: nothing changes."""
        if self._hash[block_id] is None:
            return
        self._forget(block_id)
        if self._ref_cnt[block_id] == 0:
            del self._free_cached[block_id]
            self._free_plain.append(block_id)

    def reset_cache(self) -> None:
        """Forget every hash. Blocks in use stay with their requests but can no longer be shared."""
        for block_id in list(self._cached.values()):
            self._hash[block_id] = None
        self._cached.clear()
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()

    def _forget(self, block_id: int) -> None:
        block_hash = self._hash[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hash[block_id] = None
