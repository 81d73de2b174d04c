"""Unit tests of linear-state checkpoints at any token length (cluster/kv_cache):
reconciliation across full + sliding + linear groups at lengths inside a block, state runs
spanning several pages, eviction under pressure, the cap, and drafts."""

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

BS = 4


def full():
    return FullAttentionSpec(BS, 2, 8, "float32")


def sliding(window=6):
    return SlidingWindowSpec(BS, 2, 8, "float32", sliding_window=window)


def linear(span=1):
    return LinearStateSpec(BS, (8, 3), (2, 4, 4), "float32", pages_per_state=span)


def coordinator(*specs, num_blocks=200, **kw):
    groups = [KVCacheGroup(s, [i]) for i, s in enumerate(specs)]
    return KVCacheCoordinator(groups, num_blocks, enable_caching=True, **kw)


def request(rid, tokens, salt=None):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt)


def run(coord, req, upto, step=None):
    """Schedules and 'computes' `req` up to `upto` tokens (looking up the prefix cache on
    its first schedule only); returns the hit and every step's copies."""
    first, copies = req.num_computed_tokens == 0, []
    hit = coord.find_cache_hit(req) if first else None
    if first:
        req.num_computed_tokens = hit.num_tokens
    while req.num_computed_tokens < upto:
        n = min(step or upto, upto - req.num_computed_tokens)
        assert coord.allocate_slots(req, n, hit.blocks if first else None)
        first = False
        copies.append(coord.drain_copies([req.request_id]))
        req.num_computed_tokens += n
        coord.publish_computed_blocks(req)
    return hit, copies


TOKENS = list(range(100, 160))


def test_hit_inside_a_block_is_reconciled_across_full_sliding_and_linear():
    """A request that ends at 23 tokens (inside block 5) leaves a checkpoint there; a
    request continuing the conversation hits exactly 23 in every group: 5 whole blocks and
    a copy of the block 23 ends inside for each attention group, the state for linear."""
    coord = coordinator(full(), sliding(), linear())
    a = request("a", TOKENS[:30])
    run(coord, a, 23, step=7)
    a_blocks = coord.block_ids("a")
    coord.free(a)  # ended (or preempted) at 23 computed tokens
    b = request("b", TOKENS[:23] + [7, 8, 9])
    hit, copies = run(coord, b, 26)
    assert hit.num_tokens == 23
    assert [len(h) for h in hit.blocks] == [6, 6, 1]
    assert hit.blocks[0][-1].block_id == a_blocks[0][5]
    assert hit.blocks[1][-1].block_id == a_blocks[1][5]
    before = copies[0].before
    fresh_full = coord.block_ids("b")[0][5]
    fresh_sliding = coord.block_ids("b")[1][5]
    live = coord.managers[2].live_page("b").block_id
    assert (a_blocks[0][5], fresh_full) in before and (a_blocks[1][5], fresh_sliding) in before
    assert (hit.blocks[2][0].block_id, live) in before
    # The hit's blocks before the tail are shared, not copied.
    assert coord.block_ids("b")[0][:5] == a_blocks[0][:5]
    coord.free(b)
    assert coord.pool.num_free_blocks == coord.pool.capacity


def test_tail_tokens_and_salt_must_match():
    coord = coordinator(full(), linear(), checkpoint_interval=8)
    a = request("a", TOKENS[:30])
    run(coord, a, 23, step=8)  # interval checkpoints at 8 and 16
    coord.free(a)  # and 23
    other_tail = request("b", TOKENS[:21] + [1, 2, 3, 4])
    assert coord.find_cache_hit(other_tail).num_tokens == 16
    assert coord.find_cache_hit(request("c", TOKENS[:24])).num_tokens == 23
    assert coord.find_cache_hit(request("d", TOKENS[:24], salt="t")).num_tokens == 0
    # A prompt shorter than one block still hits the checkpoint at its length.
    e = request("e", TOKENS[:3] + [9])
    run(coord, e, 3)
    coord.free(e)
    assert coord.find_cache_hit(request("f", TOKENS[:3] + [5, 6])).num_tokens == 3


def test_prompt_checkpoint_serves_requests_while_the_writer_runs():
    coord = coordinator(full(), linear())
    a = request("a", TOKENS[:14])
    assert coord.prompt_checkpoint_length(a) == 13
    run(coord, a, 13)  # the chunk the scheduler cuts one token before the prompt's end
    run(coord, a, 14)
    # The same prompt again hits all it can (its last token is always recomputed), and
    # so does a longer prompt on it.
    assert coord.find_cache_hit(request("again", TOKENS[:14])).num_tokens == 13
    b = request("b", TOKENS[:13] + [1, 2])
    hit = coord.find_cache_hit(b)
    assert hit.num_tokens == 13
    # The block 13 ends inside is still a's (it decodes on into it): b copies it.
    assert hit.blocks[0][-1].block_id == coord.block_ids("a")[0][3]
    assert hit.blocks[0][-1].ref_cnt == 1


def test_state_runs_span_pages_and_eviction_never_serves_reused_pages():
    """States span 3 pages (one aligned slab). Filling the pool with attention blocks
    takes a cached checkpoint's pages: the checkpoint is evicted whole and not served."""
    coord = coordinator(full(), linear(span=3), num_blocks=31)  # 10 slabs, slab 0 has null
    a = request("a", TOKENS[:20])
    run(coord, a, 10)
    live = coord.managers[1].live_page("a")
    assert live.block_id % 3 == 0 and [b.block_id for b in live.run] == [
        live.block_id + i for i in range(3)
    ]
    coord.free(a)
    assert coord.checkpoint_stats()["linear_state_checkpoints_kept"] == 1
    assert coord.find_cache_hit(request("b", TOKENS[:11])).num_tokens == 10
    # An attention-only "hog" of 120 tokens takes every free page, the checkpoint's too.
    manager = coord.managers[0]
    assert manager.num_new_blocks_needed("hog", 120, 0) == 30
    manager.allocate("hog", 120, 0)
    assert coord.pool.num_free_blocks == 0
    assert coord.find_cache_hit(request("c", TOKENS[:11])).num_tokens == 0
    stats = coord.checkpoint_stats()
    assert stats["linear_state_checkpoints_kept"] == 0
    assert stats["linear_state_checkpoints_evicted"] == 1
    manager.free("hog")
    assert coord.pool.num_free_blocks == coord.pool.capacity


def test_no_run_when_every_slab_holds_a_referenced_page():
    """Slabs of 3 pages: 0 (the null block, 1, 2), 1 (3-5), 2 (6-8); page 9 is in none.
    Free pages scattered over busy slabs give no state run: the allocation fails whole."""
    coord = coordinator(full(), linear(span=3), num_blocks=10)
    held = coord.pool.get_new_blocks(7)  # pages 1-7: slabs 1 and 2 busy
    a = request("a", TOKENS[:8])
    free_before = coord.pool.num_free_blocks
    assert free_before == 2 and coord.pool.num_free_runs == 0
    assert not coord.allocate_slots(a, 4)
    assert coord.pool.num_free_blocks == free_before  # took nothing
    coord.pool.free_blocks([b for b in held if b.block_id in (4, 5)])
    assert not coord.allocate_slots(a, 4)  # slab 1 still holds page 3
    coord.pool.free_blocks([b for b in held if b.block_id == 3])
    assert coord.allocate_slots(a, 4)
    assert coord.managers[1].live_page("a").block_id == 3
    coord.free(a)
    coord.pool.free_blocks([b for b in held if b.block_id not in (3, 4, 5)])
    assert coord.pool.num_free_blocks == coord.pool.capacity


def test_cap_keeps_the_newest_checkpoints():
    coord = coordinator(full(), linear(), max_checkpoints=1, bytes_per_block=1000)
    for i in range(3):
        r = request(f"r{i}", [i] * 6 + TOKENS[:6])
        run(coord, r, 9)
        coord.free(r)
    stats = coord.checkpoint_stats()
    assert stats["linear_state_checkpoints_kept"] == 1
    assert stats["linear_state_checkpoints_evicted"] == 2
    assert stats["linear_state_checkpoint_bytes"] == 1000
    assert coord.find_cache_hit(request("x", [2] * 6 + TOKENS[:4])).num_tokens == 9
    assert coord.find_cache_hit(request("y", [0] * 6 + TOKENS[:4])).num_tokens == 0
    off = coordinator(full(), linear(), max_checkpoints=0)
    r = request("r", TOKENS[:12])
    run(off, r, 9)
    off.free(r)
    assert off.find_cache_hit(request("z", TOKENS[:12])).num_tokens == 0


def test_draft_steps_take_no_checkpoint_and_rejection_publishes_the_backup():
    coord = coordinator(full(), linear(), checkpoint_interval=8)
    a = request("a", TOKENS[:7])
    run(coord, a, 7)  # one chunk (no cut at 6 here): no checkpoint from the prefill
    a.append_output_token(500)
    # A decode step with 1 real token and 3 drafts ending on the interval boundary (8):
    # drafts are unverified, so no checkpoint, and the live state is backed up first.
    assert coord.allocate_slots(a, 1, num_draft_tokens=3)
    copies = coord.drain_copies(["a"])
    assert copies.after == [] and len(copies.before) == 1
    assert coord.pending.get("a") is None
    # Every draft rejected: the scheduler takes the step back and restores the backup,
    # which holds the state at 7; the request ends there: the backup is the checkpoint.
    a.restore_state = True
    coord.free(a)
    b = request("b", TOKENS[:7] + [500, 3])
    assert coord.find_cache_hit(b).num_tokens == 7
    # Drafts taken back, no restore flagged: the live state (advanced over the drafts) is
    # not at 7 and is not published; the backup taken before the draft step is.
    c = request("c", TOKENS[20:27])
    run(coord, c, 7)
    c.append_output_token(1)
    assert coord.allocate_slots(c, 1, num_draft_tokens=2)
    coord.drain_copies(["c"])
    c.num_computed_tokens = 7  # drafts taken back, restore not yet flagged
    coord.free(c)
    assert coord.checkpoint_stats()["linear_state_checkpoints_kept"] == 2  # a's at 7, c's 7
    assert coord.find_cache_hit(request("d", TOKENS[20:27] + [1, 2])).num_tokens == 7
