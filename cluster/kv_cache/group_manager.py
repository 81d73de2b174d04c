"""Per-group block bookkeeping: which blocks a request holds, and prefix-cache lookup.

One manager per kind of memory, all drawing from the one block pool:

- full attention (and MLA) keeps every block; its hits are downward closed (any prefix of
  a hit is a hit);
- sliding window needs only the blocks that hold the last `window` tokens: older blocks are
  swapped for the null block as the request advances, and a hit at length L needs just the
  blocks under the window ending at L;
- linear attention keeps one live state (a run of pages) per request; with prefix
  caching it also publishes state checkpoints at any token length, and a hit at L needs a
  checkpoint at exactly L.

A hit may end inside an attention block: at a checkpoint's length L the block holding
[L // block_size * block_size, L) is published under the checkpoint's key too, and a hit
at L copies it into a fresh block of the new request (the rest of it is overwritten).

Each manager sees the request's chained block hashes at the pool's hash granularity;
a group whose block is `stride` hash blocks long names its block j by hash (j+1)*stride-1.
The keys of entries at other lengths (`ends`: length -> key, checkpoint_keys.py) come from
the coordinator; each group probes them under its own tag.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from kvloom.cluster.kv_cache.block_pool import BlockPool, KVBlock
from kvloom.contracts.kv_cache_spec import KVCacheSpec, SlidingWindowSpec

# `publish_due` of a group that has nothing to publish at any length.
NOTHING_TO_PUBLISH = sys.maxsize


@dataclass
class GroupHit:
    """What one group could serve: whole blocks from the start (sliding window: null
    placeholders before its window) and, by token length, the block an entry ends inside
    (attention) or the state checkpoint there (linear)."""

    blocks: list[KVBlock] = field(default_factory=list)
    ends: dict[int, KVBlock] = field(default_factory=dict)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupManager:
    """Common bookkeeping: the request's block list for this group."""

    downward_closed = True

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int, hash_block_size: int):
        self.spec = spec
        self.block_size = spec.block_size
        if self.block_size % hash_block_size:
            raise ValueError(
                f"block size {self.block_size} of KV-cache group {group_id} is not a multiple of "
                f"the hash block size {hash_block_size}"
            )
        self.stride = self.block_size // hash_block_size
        self.pool = pool
        self.group_id = group_id
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_published: dict[str, int] = {}

    @property
    def tag(self) -> bytes:
        """Prefix of this group's cache keys: every group caches the same prefix."""
        return self.group_id.to_bytes(2, "little")

    def block_hash(self, block_hashes: list[bytes], index: int) -> bytes | None:
        """The cache key of this group's block `index`: the prefix hash tagged with the
        group, since every group caches the same prefix in its own blocks."""
        position = (index + 1) * self.stride - 1
        if position >= len(block_hashes):
            return None
        return self.tag + block_hashes[position]

    def num_hashed_blocks(self, block_hashes: list[bytes]) -> int:
        return len(block_hashes) // self.stride

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block ids from index `start` on (lists only grow at the end)."""
        return [b.block_id for b in self.req_blocks.get(request_id, ())[start:]]

    def num_blocks(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, [])
        self.num_published.pop(request_id, None)
        self.pool.free_blocks([b for b in reversed(blocks) if not b.is_null])

    # Hooks with defaults for groups that hold nothing extra between steps.
    def transient_blocks(self, request_id: str) -> list[KVBlock]:
        return []

    def publish_due(self, request_id: str) -> int | None:
        """The computed length from which `publish_full_blocks` has work for the request
        again; None while it holds something the next publish releases."""
        return NOTHING_TO_PUBLISH


class FullAttentionManager(GroupManager):
    def __init__(self, spec, pool, group_id, hash_block_size):
        super().__init__(spec, pool, group_id, hash_block_size)
        # request id -> the cached block a hit ends inside, held until its copy has run
        self.hit_tails: dict[str, KVBlock] = {}
        self.tails_to_copy: dict[str, KVBlock] = {}  # ... not yet given a fresh block
        # request id -> (source, fresh block) copies for the next step
        self.pending_copies: dict[str, list[tuple[int, int]]] = {}

    def _whole_hit(self, block_hashes: list[bytes], max_tokens: int) -> list[KVBlock]:
        """The longest run of cached blocks from the start, covering <= max_tokens."""
        hits: list[KVBlock] = []
        for index in range(
            min(max_tokens // self.block_size, self.num_hashed_blocks(block_hashes))
        ):
            block = self.pool.lookup(self.block_hash(block_hashes, index))
            if block is None:
                break
            hits.append(block)
        return hits

    def find_longest_hit(
        self, block_hashes: list[bytes], max_tokens: int, ends: dict[int, bytes] | None = None
    ) -> GroupHit:
        hit = GroupHit(self._whole_hit(block_hashes, max_tokens))
        for length, key in (ends or {}).items():
            if length % self.block_size and self._serves_before(hit.blocks, length):
                block = self.pool.lookup(self.tag + key)
                if block is not None:
                    hit.ends[length] = block
        return hit

    def _serves_before(self, blocks: list[KVBlock], length: int) -> bool:
        """Whether `blocks` hold what a hit at `length` needs before its last block."""
        return length // self.block_size <= len(blocks)

    def hit_length_at_most(self, hit: GroupHit, num_tokens: int) -> int:
        best = min(
            len(hit.blocks) * self.block_size, num_tokens // self.block_size * self.block_size
        )
        for length in hit.ends:
            if best < length <= num_tokens:
                best = length
        return best

    def trim_hit(self, hit: GroupHit, num_tokens: int) -> list[KVBlock]:
        whole = hit.blocks[: num_tokens // self.block_size]
        if num_tokens % self.block_size == 0:
            return whole
        return whole + [hit.ends[num_tokens]]

    def publish_full_blocks(self, request_id: str, block_hashes: list[bytes], num_tokens: int):
        """Caches blocks that became full and written (called after the step computed them);
        a hit's copied tail block is released (its copy has run)."""
        blocks = self.req_blocks.get(request_id, [])
        start = self.num_published.get(request_id, 0)
        end = min(num_tokens // self.block_size, self.num_hashed_blocks(block_hashes), len(blocks))
        for i in range(start, end):
            if not blocks[i].is_null:
                self.pool.cache_block(blocks[i], self.block_hash(block_hashes, i))
        self.num_published[request_id] = max(start, end)
        tail = self.hit_tails.pop(request_id, None)
        if tail is not None:
            self.pool.free_blocks([tail])

    def publish_due(self, request_id: str) -> int | None:
        if request_id in self.hit_tails:
            return None
        return (self.num_published.get(request_id, 0) + 1) * self.block_size

    def cache_end(self, request_id: str, length: int, key: bytes) -> bytes | None:
        """Publishes the request's block that `length` ends inside under `key` (this
        group's tag added); returns the tagged key, or None (on a block boundary, or
        already cached)."""
        if length % self.block_size:
            blocks = self.req_blocks.get(request_id, [])
            index = length // self.block_size
            block = blocks[index] if index < len(blocks) else None
            if block is not None and not block.is_null:
                return self.tag + key if self.pool.cache_extra_key(block, self.tag + key) else None
        return None

    def num_new_blocks_needed(self, request_id: str, num_tokens: int, hit_tokens: int) -> int:
        """Blocks to take for `num_tokens` (a hit of `hit_tokens` brings its whole blocks;
        the block a hit ends inside is a fresh copy)."""
        held = len(self.req_blocks.get(request_id, ())) + hit_tokens // self.block_size
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def add_hit_blocks(self, request_id: str, hit: list[KVBlock], hit_tokens: int) -> None:
        whole = hit[: hit_tokens // self.block_size]
        self.pool.touch([b for b in whole if not b.is_null])
        self.req_blocks.setdefault(request_id, []).extend(whole)
        self.num_published[request_id] = len(self.req_blocks[request_id])
        if hit_tokens % self.block_size:
            tail = hit[-1]
            self.pool.touch([tail])
            self.hit_tails[request_id] = tail
            self.tails_to_copy[request_id] = tail

    def allocate(self, request_id: str, num_tokens: int, num_computed_tokens: int) -> None:
        blocks = self.req_blocks.setdefault(request_id, [])
        new = self.pool.get_new_blocks(self.num_new_blocks_needed(request_id, num_tokens, 0))
        tail = self.tails_to_copy.pop(request_id, None)
        if tail is not None:  # the first new block takes the place of the hit's last one
            self.pending_copies[request_id] = [(tail.block_id, new[0].block_id)]
        blocks.extend(new)

    def take_copies(self, request_id: str) -> list[tuple[int, int]]:
        """Page copies to run before this request's next step (a hit's tail block)."""
        return self.pending_copies.pop(request_id, [])

    def free(self, request_id: str) -> None:
        self.pending_copies.pop(request_id, None)
        self.tails_to_copy.pop(request_id, None)
        tail = self.hit_tails.pop(request_id, None)
        if tail is not None:
            self.pool.free_blocks([tail])
        super().free(request_id)


class SlidingWindowManager(FullAttentionManager):
    """A query at position p reads keys at positions > p - window."""

    downward_closed = False

    def __init__(self, spec: SlidingWindowSpec, pool, group_id, hash_block_size):
        super().__init__(spec, pool, group_id, hash_block_size)
        self.window = spec.sliding_window
        # Blocks the last query of a hit of length L needs: those holding [L - window, L).
        self.blocks_in_window = cdiv(self.window - 1, self.block_size)

    def _whole_hit(self, block_hashes: list[bytes], max_tokens: int) -> list[KVBlock]:
        """Scans right to left for the longest L whose window blocks are all cached;
        blocks before the window are null placeholders."""
        num = min(max_tokens // self.block_size, self.num_hashed_blocks(block_hashes))
        run = 0
        for index in range(num - 1, -1, -1):
            block = self.pool.lookup(self.block_hash(block_hashes, index))
            run = run + 1 if block is not None else 0
            if block is not None and (run >= self.blocks_in_window or index == 0):
                end = index + run  # blocks [index, end) are cached, end * block_size = L
                hits = [self.pool.null_block] * index
                hits += [
                    self.pool.lookup(self.block_hash(block_hashes, i)) for i in range(index, end)
                ]
                return hits
        return []

    def _serves_before(self, blocks: list[KVBlock], length: int) -> bool:
        """The whole blocks the queries after `length` read: from position
        length - window + 1 up to the block `length` ends inside."""
        last = length // self.block_size
        first = max(0, (length - self.window + 1) // self.block_size)
        return last <= len(blocks) and all(not b.is_null for b in blocks[first:last])

    def hit_length_at_most(self, hit: GroupHit, num_tokens: int) -> int:
        """Longest L <= num_tokens served by `hit` (L needs its window blocks real)."""
        best = 0
        for blocks in range(min(len(hit.blocks), num_tokens // self.block_size), 0, -1):
            first_needed = max(0, blocks - self.blocks_in_window)
            if all(not b.is_null for b in hit.blocks[first_needed:blocks]):
                best = blocks * self.block_size
                break
        for length in hit.ends:
            if best < length <= num_tokens:
                best = length
        return best

    def allocate(self, request_id: str, num_tokens: int, num_computed_tokens: int) -> None:
        self.release_outside_window(request_id, num_computed_tokens)
        super().allocate(request_id, num_tokens, num_computed_tokens)

    def release_outside_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Frees blocks no future query can read: those wholly before the window of the
        next token to compute (position num_computed_tokens)."""
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return
        first_needed_pos = num_computed_tokens - self.window + 1
        num_dead = max(0, first_needed_pos // self.block_size)
        dead = [b for b in blocks[:num_dead] if not b.is_null]
        for i in range(min(num_dead, len(blocks))):
            blocks[i] = self.pool.null_block
        self.pool.free_blocks(list(reversed(dead)))


class LinearStateManager(GroupManager):
    """One live state (a run of `pages_per_state` pool pages) per request. With prefix
    caching, checkpoints of it are published under the key of the prefix they hold (any
    token length): the live run itself when the request ends, or a copy made after a
    step's forward (end of a prompt's prefill, every checkpoint interval). A hit at L
    copies the checkpoint into the new live run before the step. The coordinator decides
    when (coordinator.py); this class keeps the runs."""

    downward_closed = False

    def __init__(self, spec, pool, group_id, hash_block_size):
        super().__init__(spec, pool, group_id, hash_block_size)
        self.pages_per_state = spec.pages_per_state
        # request id -> checkpoint run a hit copies from, held until the copy has run
        self.pending_hit_source: dict[str, KVBlock] = {}
        # request id -> run holding the live state as it was before a step with drafts
        self.backups: dict[str, KVBlock] = {}

    def find_longest_hit(
        self, block_hashes: list[bytes], max_tokens: int, ends: dict[int, bytes] | None = None
    ) -> GroupHit:
        hit = GroupHit()
        for length, key in (ends or {}).items():
            head = self.pool.lookup(self.tag + key)
            if head is not None and length <= max_tokens:
                hit.ends[length] = head
        return hit

    def hit_length_at_most(self, hit: GroupHit, num_tokens: int) -> int:
        """The longest checkpoint at or below num_tokens (not downward closed)."""
        return max((n for n in hit.ends if n <= num_tokens), default=0)

    def trim_hit(self, hit: GroupHit, num_tokens: int) -> list[KVBlock]:
        return [hit.ends[num_tokens]] if num_tokens in hit.ends else []

    def num_new_runs(self, request_id: str, checkpoint: bool, drafts: bool) -> int:
        runs = 0 if self.req_blocks.get(request_id) else 1
        return runs + int(checkpoint) + int(drafts and request_id not in self.backups)

    def add_hit_blocks(self, request_id: str, hit: list[KVBlock], hit_tokens: int) -> None:
        source = hit[-1]
        self.pool.touch([source])
        self.pending_hit_source[request_id] = source

    def allocate(self, request_id: str, num_tokens: int, num_computed_tokens: int) -> None:
        if not self.req_blocks.get(request_id):
            self.req_blocks[request_id] = [self.pool.get_new_run()]

    def has_backup(self, request_id: str) -> bool:
        return request_id in self.backups

    def backup_page(self, request_id: str) -> KVBlock:
        if request_id not in self.backups:
            self.backups[request_id] = self.pool.get_new_run()
        return self.backups[request_id]

    def new_run(self) -> KVBlock:
        """A run for a checkpoint copy (the coordinator holds it until it is published)."""
        return self.pool.get_new_run()

    def page_pairs(self, src: KVBlock, dst: KVBlock) -> list[tuple[int, int]]:
        """The page copies that copy state run `src` into run `dst`."""
        return [(src.block_id + i, dst.block_id + i) for i in range(self.pages_per_state)]

    def cache_state(self, head: KVBlock, key: bytes) -> bytes | None:
        """Publishes a written state run under `key` (tag added): the tagged key, or None."""
        tagged = self.tag + key
        return tagged if self.pool.cache_run(head, tagged) else None

    def publish_full_blocks(self, request_id: str, block_hashes: list[bytes], num_tokens: int):
        """After the step: a hit's source checkpoint is released (its copy has run)."""
        source = self.pending_hit_source.pop(request_id, None)
        if source is not None:
            self.pool.free_blocks([source])

    def publish_due(self, request_id: str) -> int | None:
        return None if request_id in self.pending_hit_source else NOTHING_TO_PUBLISH

    def free(self, request_id: str) -> None:
        backup = self.backups.pop(request_id, None)
        if backup is not None:
            self.pool.free_blocks([backup])
        source = self.pending_hit_source.pop(request_id, None)
        if source is not None:
            self.pool.free_blocks([source])
        super().free(request_id)

    def live_page(self, request_id: str) -> KVBlock:
        return self.req_blocks[request_id][0]
