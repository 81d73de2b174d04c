"""Per-group block bookkeeping: which blocks a request holds, and prefix-cache lookup.

One manager class per kind of memory. Full attention keeps every block and is
downward closed: any prefix of a hit is a hit.
"""

from __future__ import annotations

from kvloom.cluster.kv_cache.block_pool import BlockPool, KVBlock
from kvloom.cluster.kv_cache.spec import KVCacheSpec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FullAttentionManager:
    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int):
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.group_id = group_id
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_published: dict[str, int] = {}

    # -- prefix cache ---------------------------------------------------------------
    def find_longest_hit(self, block_hashes: list[bytes], max_tokens: int) -> list[KVBlock]:
        """The longest run of cached blocks from the start, covering <= max_tokens."""
        hits: list[KVBlock] = []
        for block_hash in block_hashes[: max_tokens // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def trim_hit(self, hit: list[KVBlock], num_tokens: int) -> list[KVBlock]:
        """Downward closed: the first num_tokens // block_size blocks are still a hit."""
        return hit[: num_tokens // self.block_size]

    def publish_full_blocks(self, request_id: str, block_hashes: list[bytes], num_tokens: int):
        """Caches blocks that became full and written (called after the step computed them)."""
        blocks = self.req_blocks.get(request_id, [])
        start = self.num_published.get(request_id, 0)
        end = min(num_tokens // self.block_size, len(block_hashes), len(blocks))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], block_hashes[i])
        self.num_published[request_id] = max(start, end)

    # -- allocation -----------------------------------------------------------------
    def num_new_blocks_needed(self, request_id: str, num_tokens: int, num_hit_blocks: int) -> int:
        held = len(self.req_blocks.get(request_id, ())) + num_hit_blocks
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def add_hit_blocks(self, request_id: str, hit: list[KVBlock]) -> None:
        self.pool.touch(hit)
        self.req_blocks.setdefault(request_id, []).extend(hit)
        # Hit blocks are already published.
        self.num_published[request_id] = len(self.req_blocks[request_id])

    def allocate(self, request_id: str, num_tokens: int) -> list[KVBlock]:
        count = self.num_new_blocks_needed(request_id, num_tokens, 0)
        new = self.pool.get_new_blocks(count)
        self.req_blocks.setdefault(request_id, []).extend(new)
        return new

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, [])
        self.num_published.pop(request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]


class LinearStateManager:
    """Linear attention: a request holds one page, its live state (conv + recurrent),
    whatever its length. Without state checkpoints there is nothing to hit."""

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int):
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.group_id = group_id
        self.req_blocks: dict[str, list[KVBlock]] = {}

    def find_longest_hit(self, block_hashes: list[bytes], max_tokens: int) -> list[KVBlock]:
        return []

    def trim_hit(self, hit: list[KVBlock], num_tokens: int) -> list[KVBlock]:
        return []

    def publish_full_blocks(self, request_id: str, block_hashes: list[bytes], num_tokens: int):
        pass

    def num_new_blocks_needed(self, request_id: str, num_tokens: int, num_hit_blocks: int) -> int:
        return 0 if self.req_blocks.get(request_id) else 1

    def add_hit_blocks(self, request_id: str, hit: list[KVBlock]) -> None:
        raise AssertionError("linear-state groups serve no prefix hits without checkpoints")

    def allocate(self, request_id: str, num_tokens: int) -> list[KVBlock]:
        if self.req_blocks.get(request_id):
            return []
        self.req_blocks[request_id] = self.pool.get_new_blocks(1)
        return self.req_blocks[request_id]

    def free(self, request_id: str) -> None:
        self.pool.free_blocks(self.req_blocks.pop(request_id, []))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]
