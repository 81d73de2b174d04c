"""Unit tests of the KV-cache coordinator: reconciliation across groups, eviction,
writers that must never be served."""

from __future__ import annotations

from kvloom.cluster.kv_cache.coordinator import KVCacheCoordinator
from kvloom.cluster.request import Request
from kvloom.contracts.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroup,
    LinearStateSpec,
    SlidingWindowSpec,
)
from kvloom.contracts.sampling_params import SamplingParams


def full(bs=4):
    return FullAttentionSpec(bs, 2, 8, "float32")


def sliding(bs=4, window=6):
    return SlidingWindowSpec(bs, 2, 8, "float32", sliding_window=window)


def linear(bs=4):
    return LinearStateSpec(bs, (8, 3), (2, 4, 4), "float32")


def coordinator(*specs, num_blocks=200, **kw):
    groups = [KVCacheGroup(s, [i]) for i, s in enumerate(specs)]
    return KVCacheCoordinator(groups, num_blocks, enable_caching=True, **kw)


def request(rid, tokens, salt=None):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt)


def compute(coord, req, num_tokens, step=None):
    """Schedules and 'computes' a request up to num_tokens in chunks of `step` (looking up
    the prefix cache only on its first schedule)."""
    first = req.num_computed_tokens == 0
    hit = coord.find_cache_hit(req) if first else None
    if first:
        req.num_computed_tokens = hit.num_tokens
    while req.num_computed_tokens < num_tokens:
        n = min(step or num_tokens, num_tokens - req.num_computed_tokens)
        assert coord.allocate_slots(req, n, hit.blocks if first else None)
        first = False
        coord.drain_copies([req.request_id])
        req.num_computed_tokens += n
        coord.publish_computed_blocks(req)
    return hit


TOKENS = list(range(100, 140))  # 40 tokens = 10 blocks of 4


def test_full_attention_hit_is_downward_closed():
    coord = coordinator(full())
    a = request("a", TOKENS)
    compute(coord, a, 40)
    b = request("b", TOKENS[:23] + [1, 2, 3])
    assert coord.find_cache_hit(b).num_tokens == 20  # 5 whole shared blocks


def test_conflicting_groups_settle_on_common_length():
    """Full attention could serve 36 tokens of the running request, but the linear group
    has checkpoints only at the 16-token interval (16 and 32): the hit is 32 and the full
    group is trimmed to 8 blocks."""
    coord = coordinator(full(), linear(), checkpoint_interval=16)
    a = request("a", TOKENS)
    compute(coord, a, 16)
    compute(coord, a, 32)
    compute(coord, a, 38)
    b = request("b", TOKENS)
    hit = coord.find_cache_hit(b)
    assert hit.num_tokens == 32
    assert len(hit.blocks[0]) == 8
    assert len(hit.blocks[1]) == 1 and hit.blocks[1][-1].block_hash is not None


def test_missing_linear_checkpoint_shortens_hit():
    coord = coordinator(full(), linear(), checkpoint_interval=16)
    a = request("a", TOKENS)
    # Chunks end at 16 and 30: only the 16-token boundary holds a checkpoint.
    compute(coord, a, 16)
    compute(coord, a, 30)
    b = request("b", TOKENS)
    assert coord.find_cache_hit(b).num_tokens == 16


def test_full_groups_with_block_sizes_16_and_32_trimmed_to_common_boundary():
    coord = coordinator(full(16), full(32))
    assert coord.hash_block_size == 16
    tokens = list(range(1000, 1100))
    a = request("a", tokens)
    compute(coord, a, 80)  # 5 blocks of 16, 2 full blocks of 32 (64 tokens)
    b = request("b", tokens)
    hit = coord.find_cache_hit(b)
    assert hit.num_tokens == 64
    assert len(hit.blocks[0]) == 4 and len(hit.blocks[1]) == 2


def test_sliding_window_only_hit_needs_only_window_blocks():
    coord = coordinator(sliding(bs=4, window=6))
    a = request("a", TOKENS)
    compute(coord, a, 40, step=4)  # blocks outside the window were released on the way
    coord.free(a)
    # Evict the prefix's first blocks: a sliding hit does not need them.
    first_hashes = a.block_hashes[:3]
    for h in first_hashes:
        block = coord.pool.lookup((0).to_bytes(2, "little") + h)
        if block is not None:
            coord.pool._evict(block)
    b = request("b", TOKENS + [7])
    hit = coord.find_cache_hit(b)
    assert hit.num_tokens == 40
    assert hit.blocks[0][0].is_null  # evicted head stands in as the null block
    assert not any(blk.is_null for blk in hit.blocks[0][-2:])


def test_same_step_writer_is_never_served():
    """Blocks are published only after the step that writes them has run."""
    coord = coordinator(full())
    a = request("a", TOKENS)
    assert coord.allocate_slots(a, 40)  # scheduled, not yet computed
    b = request("b", TOKENS)
    assert coord.find_cache_hit(b).num_tokens == 0
    a.num_computed_tokens = 40
    coord.publish_computed_blocks(a)
    assert coord.find_cache_hit(b).num_tokens == 36  # last token always recomputed


def test_aborted_writer_is_never_served():
    coord = coordinator(full(), linear(), checkpoint_interval=16)
    a = request("a", TOKENS)
    assert coord.allocate_slots(a, 16)  # the step would end on a checkpoint interval
    coord.free(a)  # aborted before the step's results came back
    b = request("b", TOKENS)
    assert coord.find_cache_hit(b).num_tokens == 0
    assert coord.pool.num_free_blocks == coord.pool.capacity


def test_eviction_is_lru_and_spares_referenced_blocks():
    coord = coordinator(full(), num_blocks=13)  # 12 usable blocks
    old = request("old", list(range(0, 16)))
    compute(coord, old, 16)
    coord.free(old)  # 4 cached, unreferenced (freed first: evicted first)
    live = request("live", list(range(500, 516)))
    compute(coord, live, 16)  # 4 referenced
    newer = request("newer", list(range(900, 916)))
    compute(coord, newer, 16)
    coord.free(newer)  # 4 cached, unreferenced, freed later
    grab = request("grab", list(range(2000, 2016)))
    compute(coord, grab, 16)  # needs 4 blocks: evicts "old"'s, not "newer"'s or "live"'s
    assert coord.find_cache_hit(request("x", list(range(0, 16)) + [1])).num_tokens == 0
    assert coord.find_cache_hit(request("y", list(range(900, 916)) + [1])).num_tokens == 16
    assert all(b.ref_cnt == 1 for b in coord.managers[0].req_blocks["live"])
    coord.free(live)
    coord.free(grab)
    assert coord.pool.num_free_blocks == coord.pool.capacity


def test_cache_salt_separates_tenants():
    coord = coordinator(full())
    compute(coord, request("a", TOKENS, salt="tenant-a"), 40)
    assert coord.find_cache_hit(request("b", TOKENS, salt="tenant-b")).num_tokens == 0
    assert coord.find_cache_hit(request("c", TOKENS)).num_tokens == 0
    assert coord.find_cache_hit(request("d", TOKENS, salt="tenant-a")).num_tokens == 36


def test_hit_copies_checkpoint_into_fresh_live_page():
    coord = coordinator(full(), linear(), checkpoint_interval=16)
    a = request("a", TOKENS)
    compute(coord, a, 16)
    b = request("b", TOKENS[:20])
    hit = coord.find_cache_hit(b)
    b.num_computed_tokens = hit.num_tokens
    assert coord.allocate_slots(b, 3, hit.blocks)
    copies = coord.drain_copies(["b"])
    live = coord.managers[1].live_page("b").block_id
    assert copies.before == [(hit.blocks[1][-1].block_id, live)]
    # 19, one token before b's prompt ends: a checkpoint
    assert copies.after and copies.after[0][0] == live


def test_decode_steps_inside_held_blocks_take_nothing():
    """Full attention only: a step whose tokens fit the request's blocks returns at once
    (the pool is untouched); one that crosses a block boundary takes exactly one block, as
    does a sliding-window model, which always takes the full path (it frees blocks that
    leave the window)."""
    for specs, window in (((full(), full(8)), False), ((full(), sliding()), True)):
        coord = coordinator(*specs, num_blocks=40)
        assert coord._plain_attention is not window
        req = request("r", TOKENS[:6])
        compute(coord, req, 6)
        free = coord.pool.num_free_blocks
        held = [len(m.req_blocks["r"]) for m in coord.managers]
        assert coord.allocate_slots(req, 1)  # token 7 fits block 2 of 4 and block 1 of 8
        assert coord.pool.num_free_blocks == free
        assert [len(m.req_blocks["r"]) for m in coord.managers] == held
        req.num_computed_tokens = 8
        assert coord.allocate_slots(req, 1)  # token 9 starts block 3 (size 4)
        assert len(coord.managers[0].req_blocks["r"]) == held[0] + 1
        # Lookahead slots count too: 9 + 4 tokens reach a new block of 8 in group 1.
        assert coord.allocate_slots(req, 1, num_lookahead_tokens=4)
        if not window:
            assert len(coord.managers[1].req_blocks["r"]) == held[1] + 1
