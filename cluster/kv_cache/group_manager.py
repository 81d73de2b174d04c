"""Per-group block bookkeeping: which blocks a request holds, and prefix-cache lookup.

One manager per kind of memory, all drawing from the one block pool:

- full attention (and MLA) keeps every block; its hits are downward closed (any prefix of
  a hit is a hit);
- sliding window needs only the blocks that hold the last `window` tokens: older blocks are
  swapped for the null block as the request advances, and a hit at length L needs just the
  blocks under the window ending at L;
- linear attention keeps one live state page per request; with prefix caching it also
  publishes state checkpoints at block boundaries, and a hit at L needs a checkpoint at
  exactly L.

Each manager sees the request's chained block hashes at the pool's hash granularity;
a group whose block is `stride` hash blocks long names its block j by hash (j+1)*stride-1.
"""

from __future__ import annotations

from kvloom.cluster.kv_cache.block_pool import BlockPool, KVBlock
from kvloom.contracts.kv_cache_spec import KVCacheSpec, SlidingWindowSpec


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

    def block_hash(self, block_hashes: list[bytes], index: int) -> bytes | None:
        """The cache key of this group's block `index`: the prefix hash tagged with the
        group, since every group caches the same prefix in its own blocks."""
        position = (index + 1) * self.stride - 1
        if position >= len(block_hashes):
            return None
        return self.group_id.to_bytes(2, "little") + block_hashes[position]

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


class FullAttentionManager(GroupManager):
    def find_longest_hit(self, block_hashes: list[bytes], max_tokens: int) -> list[KVBlock]:
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

    def hit_length_at_most(self, hit: list[KVBlock], num_tokens: int) -> int:
        return min(len(hit) * self.block_size, num_tokens // self.block_size * self.block_size)

    def trim_hit(self, hit: list[KVBlock], num_tokens: int) -> list[KVBlock]:
        return hit[: num_tokens // self.block_size]

    def publish_full_blocks(self, request_id: str, block_hashes: list[bytes], num_tokens: int):
        """Caches blocks that became full and written (called after the step computed them)."""
        blocks = self.req_blocks.get(request_id, [])
        start = self.num_published.get(request_id, 0)
        end = min(num_tokens // self.block_size, self.num_hashed_blocks(block_hashes), len(blocks))
        for i in range(start, end):
            if not blocks[i].is_null:
                self.pool.cache_block(blocks[i], self.block_hash(block_hashes, i))
        self.num_published[request_id] = max(start, end)

    def num_new_blocks_needed(self, request_id: str, num_tokens: int, num_hit_blocks: int) -> int:
        held = len(self.req_blocks.get(request_id, ())) + num_hit_blocks
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def add_hit_blocks(self, request_id: str, hit: list[KVBlock]) -> None:
        self.pool.touch([b for b in hit if not b.is_null])
        self.req_blocks.setdefault(request_id, []).extend(hit)
        self.num_published[request_id] = len(self.req_blocks[request_id])

    def allocate(self, request_id: str, num_tokens: int, num_computed_tokens: int) -> None:
        count = self.num_new_blocks_needed(request_id, num_tokens, 0)
        self.req_blocks.setdefault(request_id, []).extend(self.pool.get_new_blocks(count))


class SlidingWindowManager(FullAttentionManager):
    """A query at position p reads keys at positions > p - window."""

    downward_closed = False

    def __init__(self, spec: SlidingWindowSpec, pool, group_id, hash_block_size):
        super().__init__(spec, pool, group_id, hash_block_size)
        self.window = spec.sliding_window
        # Blocks the last query of a hit of length L needs: those holding [L - window, L).
        self.blocks_in_window = cdiv(self.window - 1, self.block_size)

    def find_longest_hit(self, block_hashes: list[bytes], max_tokens: int) -> list[KVBlock]:
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

    def hit_length_at_most(self, hit: list[KVBlock], num_tokens: int) -> int:
        """Longest L <= num_tokens served by `hit` (L needs its window blocks real)."""
        for blocks in range(min(len(hit), num_tokens // self.block_size), 0, -1):
            first_needed = max(0, blocks - self.blocks_in_window)
            if all(not b.is_null for b in hit[first_needed:blocks]):
                return blocks * self.block_size
        return 0

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
    """One live state page per request. With prefix caching (align mode) the scheduler ends
    prefill chunks on block boundaries; whenever a step ends on a boundary the live state is
    copied, after the forward, into a fresh page that is published under the prefix's hash
    (a checkpoint). A hit at length L copies the checkpoint into the new live page."""

    downward_closed = False

    def __init__(self, spec, pool, group_id, hash_block_size):
        super().__init__(spec, pool, group_id, hash_block_size)
        # request id -> [(checkpoint page, its boundary in tokens)] taken by steps not yet
        # published, oldest first (with async scheduling the step scheduled ahead may take
        # one before the step in flight is read back)
        self.pending_checkpoints: dict[str, list[tuple[KVBlock, int]]] = {}
        # request id -> checkpoint page a hit copies from, held until the copy has run
        self.pending_hit_source: dict[str, KVBlock] = {}
        # request id -> page holding the live state as it was before a step with drafts
        self.backups: dict[str, KVBlock] = {}

    def find_longest_hit(self, block_hashes: list[bytes], max_tokens: int) -> list[KVBlock]:
        """[checkpoint page] for the longest boundary <= max_tokens that has one."""
        for index in range(
            min(max_tokens // self.block_size, self.num_hashed_blocks(block_hashes)) - 1, -1, -1
        ):
            block = self.pool.lookup(self.block_hash(block_hashes, index))
            if block is not None:
                return [self.pool.null_block] * index + [block]
        return []

    def hit_length_at_most(self, hit: list[KVBlock], num_tokens: int) -> int:
        """Only the exact checkpoint length serves (not downward closed)."""
        length = len(hit) * self.block_size
        return length if hit and length <= num_tokens else 0

    def trim_hit(self, hit: list[KVBlock], num_tokens: int) -> list[KVBlock]:
        return hit if len(hit) * self.block_size == num_tokens else []

    def num_new_blocks_needed(self, request_id: str, num_tokens: int, num_hit_blocks: int) -> int:
        return 0 if self.req_blocks.get(request_id) else 1

    def add_hit_blocks(self, request_id: str, hit: list[KVBlock]) -> None:
        source = hit[-1]
        self.pool.touch([source])
        self.pending_hit_source[request_id] = source

    def allocate(self, request_id: str, num_tokens: int, num_computed_tokens: int) -> None:
        if not self.req_blocks.get(request_id):
            self.req_blocks[request_id] = self.pool.get_new_blocks(1)

    def has_backup(self, request_id: str) -> bool:
        return request_id in self.backups

    def backup_page(self, request_id: str) -> KVBlock:
        if request_id not in self.backups:
            self.backups[request_id] = self.pool.get_new_blocks(1)[0]
        return self.backups[request_id]

    def checkpoint_needed(self, num_tokens_after_step: int) -> bool:
        return self.pool.enable_caching and num_tokens_after_step % self.block_size == 0

    def take_checkpoint_page(self, request_id: str, boundary: int) -> KVBlock:
        page = self.pool.get_new_blocks(1)[0]
        self.pending_checkpoints.setdefault(request_id, []).append((page, boundary))
        return page

    def publish_full_blocks(self, request_id: str, block_hashes: list[bytes], num_tokens: int):
        """After the step: the checkpoint written at the end of the forward becomes a hit
        target; the request drops its reference (the page stays cached until evicted).

        With async scheduling a checkpoint of the step scheduled ahead may be pending too.
        Its block's hash may not be known yet (its last input token is still in flight);
        it waits for a later call. One whose hash is known is published now: a request
        that hits it runs in a later step, queued behind the step that writes it (as for
        attention blocks, docs/async_scheduling.md)."""
        waiting = []
        for page, boundary in self.pending_checkpoints.pop(request_id, ()):
            block_hash = self.block_hash(block_hashes, boundary // self.block_size - 1)
            if boundary <= num_tokens and block_hash is not None:
                self.pool.cache_block(page, block_hash)
                self.pool.free_blocks([page])
            else:
                waiting.append((page, boundary))
        if waiting:
            self.pending_checkpoints[request_id] = waiting
        source = self.pending_hit_source.pop(request_id, None)
        if source is not None:
            self.pool.free_blocks([source])

    def free(self, request_id: str) -> None:
        backup = self.backups.pop(request_id, None)
        if backup is not None:
            self.pool.free_blocks([backup])
        for page, _ in self.pending_checkpoints.pop(request_id, ()):
            self.pool.free_blocks([page])  # not published
        source = self.pending_hit_source.pop(request_id, None)
        if source is not None:
            self.pool.free_blocks([source])
        super().free(request_id)

    def live_page(self, request_id: str) -> KVBlock:
        return self.req_blocks[request_id][0]
