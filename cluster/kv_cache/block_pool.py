"""One pool of equal-size pages shared by every KV-cache group.

Blocks carry a reference count. A block whose count drops to zero joins the free queue;
if it holds a prefix-cache hash it stays findable until it is evicted, which happens
in LRU order when a new block is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    # The null block (id 0) stands in block tables for blocks a request no longer needs
    # (outside a sliding window, before a linear-state checkpoint); it is never handed out.
    is_null: bool = False

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt})"


class BlockPool:
    """`num_blocks` pages; page 0 is the null block, so `capacity` = num_blocks - 1."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, sanitize: bool = False):
        if num_blocks < 2:
            raise ValueError(
                f"num_kv_blocks must be >= 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.sanitize = sanitize
        self.null_block = KVBlock(0, ref_cnt=1, is_null=True)
        self.blocks = [self.null_block] + [KVBlock(i) for i in range(1, num_blocks)]
        # Insertion order is eviction order: least recently freed first.
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self._cached: dict[bytes, KVBlock] = {}
        # Blocks whose contents became garbage since the last drain (sanitizer NaN-fills).
        self._to_poison: list[int] = []
        self.num_evictions = 0

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        out = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1
            if self.sanitize:
                self._to_poison.append(block.block_id)

    def touch(self, blocks: list[KVBlock]) -> None:
        """Takes a reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drops a reference on each block; pass a request's blocks tail first so the
        tail of a prefix is evicted before its head."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of block {block.block_id}"
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None and self.sanitize:
                    self._to_poison.append(block.block_id)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Publishes a full, written block under its hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self._cached.setdefault(block_hash, block)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def drain_poison_list(self) -> list[int]:
        """Block ids to NaN-fill before the next step (sanitizer only)."""
        out, self._to_poison = self._to_poison, []
        return out

    def reset_prefix_cache(self) -> None:
        for block in list(self._cached.values()):
            if block.ref_cnt == 0:
                self._evict(block)
