"""KV cache manager and block pool: allocation, chained-hash prefix hits, ref counts, LRU eviction."""

from __future__ import annotations

import pytest

from engine_server.core.block_pool import BlockPool
from engine_server.core.kv_cache_manager import KVCacheManager, hash_block, root_hash
from engine_server.core.request import Request
from tests.unit.factories import make_request

BS = 16


def schedule_all(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit `req` the way the scheduler does and compute its whole known sequence in one chunk."""
    blocks, num_cached = kv.get_computed_blocks(req)
    table = kv.allocate_slots(req, req.num_tokens - num_cached, blocks)
    assert table is not None
    req.num_computed_tokens = req.num_tokens
    return table


def test_allocate_and_free_accounting() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("a", 40)
    table = kv.allocate_slots(req, 40)
    assert table is not None and len(table) == 3
    assert kv.block_table("a") == table
    assert (kv.num_free_blocks, kv.num_used_blocks, kv.usage) == (7, 3, pytest.approx(0.3))
    req.num_computed_tokens = 40
    # Growing inside the last block needs nothing new; crossing a boundary needs one more block.
    assert kv.allocate_slots(req, 8) == table and len(table) == 3
    req.num_computed_tokens = 48
    assert len(kv.allocate_slots(req, 1) or []) == 4
    kv.free(req)
    assert kv.num_free_blocks == 10 and kv.block_table("a") == []


def test_allocate_fails_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    big = make_request("big", 100)
    assert kv.allocate_slots(big, 100) is None
    assert kv.num_free_blocks == 4 and kv.block_table("big") == []
    small = make_request("small", 30)
    assert kv.allocate_slots(small, 30) is not None
    assert kv.allocate_slots(make_request("x", 48), 48) is None
    assert kv.num_free_blocks == 2


def test_prefix_hit_shares_a_long_prefix() -> None:
    kv = KVCacheManager(num_blocks=100, block_size=BS)
    prefix = list(range(500))
    first = make_request("a", [*prefix, 900, 901])
    schedule_all(kv, first)
    second = make_request("b", [*prefix, 7, 8, 9])
    blocks, num_cached = kv.get_computed_blocks(second)
    assert num_cached == 496 >= 480
    assert blocks == kv.block_table("a")[:31]
    table = kv.allocate_slots(second, second.num_tokens - num_cached, blocks)
    assert table is not None and table[:31] == blocks and table[31] != kv.block_table("a")[31]
    assert all(kv.pool.ref_count(b) == 2 for b in blocks)


def test_hashes_are_chained_not_per_block() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    schedule_all(kv, make_request("a", [1] * BS + [2] * BS + [3]))
    # Same second block after a different first block: no hit at all.
    assert kv.get_computed_blocks(make_request("b", [9] * BS + [2] * BS + [3])) == ([], 0)
    assert hash_block(hash_block(b"", [1] * BS), [2] * BS) != hash_block(hash_block(b"", [9] * BS), [2] * BS)


def salted(request: Request, cache_salt: str) -> Request:
    request.cache_salt = cache_salt
    return request


def test_requests_with_different_salts_never_share_a_block() -> None:
    kv = KVCacheManager(num_blocks=100, block_size=BS)
    prompt = list(range(200))
    schedule_all(kv, salted(make_request("a", prompt), "project-a"))
    assert kv.get_computed_blocks(salted(make_request("b", prompt), "project-b")) == ([], 0)
    assert kv.get_computed_blocks(make_request("unsalted", prompt)) == ([], 0)
    schedule_all(kv, make_request("u", prompt))
    assert kv.get_computed_blocks(salted(make_request("c", prompt), "project-c")) == ([], 0)


def test_requests_with_the_same_salt_share_their_prefix() -> None:
    kv = KVCacheManager(num_blocks=100, block_size=BS)
    prompt = list(range(200))
    schedule_all(kv, salted(make_request("a", prompt), "project-a"))
    blocks, num_cached = kv.get_computed_blocks(salted(make_request("a2", [*prompt, 5]), "project-a"))
    assert num_cached == 192 and blocks == kv.block_table("a")[:12]


def test_an_empty_salt_keeps_the_unsalted_hashes() -> None:
    """No salt is the chain ladle always had, from the empty root; a salt starts it elsewhere."""
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = [1] * BS + [2] * BS + [3]
    plain, empty = make_request("a", prompt), salted(make_request("b", prompt), "")
    schedule_all(kv, plain)
    assert root_hash("") == b""
    assert plain.block_hashes == [hash_block(b"", [1] * BS), hash_block(hash_block(b"", [1] * BS), [2] * BS)]
    assert kv.get_computed_blocks(empty) == (kv.block_table("a")[:2], 32) and empty.block_hashes == plain.block_hashes
    salty = salted(make_request("c", prompt), "s")
    kv.get_computed_blocks(salty)
    assert salty.block_hashes[0] == hash_block(root_hash("s"), [1] * BS) != plain.block_hashes[0]
    assert len({root_hash("s"), root_hash("t"), root_hash("")}) == 3


@pytest.mark.parametrize("path", ["slots_for_decodes", "slot_for_one"])
def test_a_decode_that_fills_the_first_block_hashes_from_the_salt(path: str) -> None:
    """The decode paths publish a block a decode filled with the request's salted chain too."""
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    req = salted(make_request("a", list(range(BS - 1))), "project-a")
    schedule_all(kv, req)
    req.append_output_token(99)
    if path == "slots_for_decodes":
        assert kv.slots_for_decodes([req]) == 1
    else:
        assert kv.slot_for_one(req) is not None
    assert req.block_hashes == [hash_block(root_hash("project-a"), [*range(BS - 1), 99])]
    follow_up = [*range(BS - 1), 99, 7]
    assert kv.get_computed_blocks(salted(make_request("b", follow_up), "project-a"))[1] == BS
    assert kv.get_computed_blocks(salted(make_request("c", follow_up), "project-c"))[1] == 0


def test_partial_last_block_and_whole_prompt_never_shared() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    schedule_all(kv, make_request("a", list(range(20))))
    assert kv.get_computed_blocks(make_request("b", list(range(20))))[1] == 16  # block 2 is partial
    schedule_all(kv, make_request("c", list(range(100, 132))))
    # Two full cached blocks, but the last prompt token must be computed to have logits: one hit only.
    assert kv.get_computed_blocks(make_request("d", list(range(100, 132))))[1] == 16
    assert kv.get_computed_blocks(make_request("e", list(range(100, 133))))[1] == 32


def test_output_tokens_are_hashed_too() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    req = make_request("a", list(range(10)))
    schedule_all(kv, req)
    for tok in range(50, 60):  # decode 10 tokens: block 0 fills with prompt + outputs
        req.append_output_token(tok)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    follow_up = make_request("b", [*range(10), *range(50, 60)])
    assert kv.get_computed_blocks(follow_up) == (kv.block_table("a")[:1], 16)


def test_freed_cached_blocks_stay_reusable_and_evict_lru() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", 33)  # 2 full blocks + 1 partial
    b = make_request("b", 33)
    table_a, table_b = schedule_all(kv, a), schedule_all(kv, b)
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 6
    # Still cached after free: a new copy of "a" hits both full blocks.
    again = make_request("a2", list(a.prompt_token_ids))
    assert kv.get_computed_blocks(again) == (table_a[:2], 32)
    # Three blocks: the two never-hashed partial ones, then the least recently freed cached block,
    # which is a's tail (a was freed before b, tail first).
    new = kv.allocate_slots(make_request("c", 48), 48)
    assert new is not None and set(new) == {table_a[2], table_b[2], table_a[1]}
    assert kv.get_computed_blocks(again) == (table_a[:1], 16)
    assert kv.get_computed_blocks(make_request("b2", list(b.prompt_token_ids)))[1] == 32


def test_cache_hit_on_free_block_counts_against_free_space() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", 33)
    schedule_all(kv, a)
    kv.free(a)
    clone = make_request("clone", [*a.prompt_token_ids[:32], 5, 6, 7])
    blocks, num_cached = kv.get_computed_blocks(clone)
    assert num_cached == 32
    # Reviving the two cached blocks leaves one free block: enough for 16 new tokens, not for 17.
    assert kv.allocate_slots(clone, 17, blocks) is None
    assert kv.num_free_blocks == 3
    assert kv.allocate_slots(clone, 16, blocks) is not None
    assert kv.num_free_blocks == 0 and [kv.pool.ref_count(b) for b in blocks] == [1, 1]


def test_ref_counts_with_several_sharers() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    reqs = [make_request(f"r{i}", list(range(40))) for i in range(3)]
    tables = [schedule_all(kv, r) for r in reqs]
    shared = tables[0][:2]
    assert all(t[:2] == shared for t in tables)
    assert len({t[2] for t in tables}) == 3  # partial tails stay private
    assert [kv.pool.ref_count(b) for b in shared] == [3, 3]
    kv.free(reqs[0])
    kv.free(reqs[1])
    assert [kv.pool.ref_count(b) for b in shared] == [1, 1]
    assert kv.num_used_blocks == 3
    kv.free(reqs[2])
    assert kv.num_free_blocks == 20


def test_reset_prefix_cache_and_disabled_caching() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", 40)
    schedule_all(kv, a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", list(a.prompt_token_ids)))[1] == 0
    kv.free(a)
    assert kv.num_free_blocks == 10

    off = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    schedule_all(off, make_request("a", list(range(40))))
    assert off.get_computed_blocks(make_request("b", list(range(40)))) == ([], 0)


def test_block_pool_duplicate_hash_stays_private() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    assert pool.register(first, b"h") and not pool.register(second, b"h")
    assert pool.lookup(b"h") == first and pool.block_hash(second) is None
    with pytest.raises(ValueError):
        pool.allocate(3)


def test_slots_in_place_only_when_nothing_is_allocated_or_published() -> None:
    """The scheduler's fast check: the table when the new tokens fit the blocks held and fill none of them."""
    manager = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("r", 6)
    assert manager.slots_in_place(request, 1) is None  # holds no blocks yet
    table = manager.allocate_slots(request, 6)
    assert table is not None
    request.num_computed_tokens = 6
    request.append_output_token(3)
    request.append_output_token(4)
    assert manager.slots_in_place(request, 1) is table  # position 6: inside block 1, which stays partial
    assert manager.slots_in_place(request, 2) is None  # the 8th token fills block 1: it must be published
    request.num_computed_tokens = 8
    assert manager.slots_in_place(request, 1) is None  # position 8 needs a third block
    assert manager.num_free_blocks == 6  # none of the checks allocated


def _fits_without_allocating(manager: KVCacheManager, request: Request, num_new: int) -> bool:
    """`slots_in_place`'s rule from the manager's own state: the new tokens fit the blocks held, and fill no
    block that is not settled yet."""
    table = manager.block_table(request.request_id)
    num_total = request.num_computed_tokens + num_new
    if not table or num_total > len(table) * manager.block_size:
        return False
    settled = manager._num_settled.get(request.request_id, 0)
    return not manager.enable_prefix_caching or min(num_total, request.num_tokens) // manager.block_size <= settled


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_in_place_bound_on_the_request_never_overstates(prefix_caching: bool) -> None:
    """The scheduler trusts `request.num_slots_in_place` without asking the manager: below it, the rule above
    must hold, through decodes, chunks, shared prefixes, prefix-cache resets, frees and re-admissions."""
    import random

    rng = random.Random(7)
    manager = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=prefix_caching)
    shared = [rng.randrange(50) for _ in range(9)]
    requests = [make_request(f"r{i}", shared + [i] * rng.randrange(1, 7), max_tokens=None) for i in range(4)]
    checked = 0
    for _ in range(400):
        request = rng.choice(requests)
        action = rng.random()
        if action < 0.1:
            manager.free(request)
            request.num_computed_tokens = 0
        elif action < 0.15:
            manager.reset_prefix_cache()
        else:
            if request.num_computed_tokens == 0 and not manager.block_table(request.request_id):
                blocks, cached = manager.get_computed_blocks(request)
                table = manager.allocate_slots(request, request.num_tokens - cached, blocks)
                if table is not None:
                    request.num_computed_tokens = request.num_tokens
            else:
                num_new = max(1, request.num_tokens - request.num_computed_tokens)
                if manager.allocate_slots(request, num_new) is not None:
                    request.num_computed_tokens += num_new
                    if request.num_computed_tokens == request.num_tokens:
                        request.append_output_token(rng.randrange(50))
        for other in requests:
            for num_new in range(1, 10):
                if other.num_computed_tokens + num_new <= other.num_slots_in_place:
                    checked += 1
                    assert _fits_without_allocating(manager, other, num_new), (other, num_new)
                    assert other.block_ids is manager.block_table(other.request_id)
                    assert manager.slots_in_place(other, num_new) is other.block_ids
    assert checked > 100  # the bound is used, not just never set


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_slot_for_one_is_slots_in_place_then_allocate_slots(prefix_caching: bool) -> None:
    """Decode by decode across block boundaries (and into a pool that runs dry), the one-token path leaves
    the very tables, publications, in-place bounds and free counts of the general one."""
    general, fast = (KVCacheManager(num_blocks=9, block_size=4, enable_prefix_caching=prefix_caching) for _ in "ab")
    pair = [(make_request(name, 6), make_request(name, 6)) for name in ("a", "b")]
    for kv, index in ((general, 0), (fast, 1)):
        for requests in pair:
            schedule_all(kv, requests[index])
    for step in range(12):
        for requests in pair:
            g, f = requests
            expected = general.slots_in_place(g, 1)
            if expected is None:
                expected = general.allocate_slots(g, 1)
            got = fast.slot_for_one(f)
            assert (got is None) == (expected is None), step
            assert got == expected and f.num_slots_in_place == g.num_slots_in_place
            if got is not None:
                for r in requests:
                    r.num_computed_tokens += 1
                    r.append_output_token(100 + step)
        assert general.num_free_blocks == fast.num_free_blocks
        assert [general.pool.block_hash(b) for b in range(9)] == [fast.pool.block_hash(b) for b in range(9)]
    assert general.num_free_blocks == 0  # the pool ran dry on the way: both refused alike


def decode(kv: KVCacheManager, request: Request, steps: int, served: str = "one") -> list[int]:
    """`steps` decode steps of `request` (computed, its one new token appended), each scheduled as the scheduler
    does (`slot_for_one`, or `slots_for_decodes` for a list); returns the most blocks it held at any step."""
    held = []
    for step in range(steps):
        if served == "one":
            assert kv.slot_for_one(request) is not None
        else:
            assert kv.slots_for_decodes([request]) == 1
        request.num_computed_tokens += 1
        request.append_output_token(1000 + step)
        table = kv.block_table(request.request_id)
        held.append(sum(b != kv.released_block for b in table))
        if kv.window:  # released: exactly the blocks wholly before the window of the last token scheduled, but one
            first_seen = (request.num_computed_tokens - 1 - kv.window + 1) // BS
            released = [i for i, b in enumerate(table) if b == kv.released_block]
            assert released == list(range(len(released))) and len(released) in (first_seen - 1, first_seen - 2, 0)
            assert all(b != kv.released_block for b in table[first_seen:])
    return held


@pytest.mark.parametrize("served", ["one", "list"])
def test_a_window_releases_the_blocks_no_later_token_can_see(served: str) -> None:
    """Window 20 over 16-token blocks: once its 100-token prompt's blocks fall behind, a decoding request holds 4
    blocks at every step (the at most 3 a window of 20 spans, and one kept as a margin: about window / 16 + 2),
    against 25 without a window; every released place holds the scratch block, and freeing the request returns
    the rest."""
    kv = KVCacheManager(num_blocks=64, block_size=BS, window=20)
    request = make_request("a", 100, max_tokens=400)
    schedule_all(kv, request)
    assert kv.num_free_blocks == 64 - 7
    held = decode(kv, request, 300, served)
    table = kv.block_table("a")
    assert len(table) == -(-400 // BS) and set(held[50:]) == {4} and held[-1] == 64 - kv.num_free_blocks
    live = [b for b in table if b != kv.released_block]
    assert table[: len(table) - len(live)] == [kv.released_block] * (len(table) - len(live))
    # Every block a token still to come can see is held: from the block of position 400 - 20 + 1 on.
    assert len(live) >= len(table) - (400 - 20 + 1) // BS
    kv.free(request)
    assert kv.num_free_blocks == 64 and kv.pool.num_blocks == 64


def test_a_released_block_stays_in_the_prefix_cache() -> None:
    """A released block that was published is a cached free block: a new request with the same prompt gets a
    prefix hit on it (until it is evicted)."""
    kv = KVCacheManager(num_blocks=64, block_size=BS, window=20)
    prompt = list(range(100, 164))  # four full blocks
    first = make_request("a", prompt, max_tokens=200)
    schedule_all(kv, first)
    decode(kv, first, 40)
    assert kv.block_table("a")[0] == kv.released_block
    second = make_request("b", prompt)
    blocks, cached = kv.get_computed_blocks(second)
    assert cached == 48 and len(blocks) == 3 and kv.released_block not in blocks


def test_without_a_window_nothing_is_released() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    request = make_request("a", 100, max_tokens=400)
    schedule_all(kv, request)
    assert decode(kv, request, 300)[-1] == 25 and kv.released_block not in kv.block_table("a")
    with pytest.raises(ValueError, match="window"):
        KVCacheManager(num_blocks=4, block_size=BS, window=-1)
