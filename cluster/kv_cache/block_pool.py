"""One pool of equal-size pages shared by every KV-cache group.

Blocks carry a reference count. A block whose count drops to zero joins the free queue;
if it holds a prefix-cache key it stays findable until it is evicted, which happens in
LRU order when a new block is needed.

A recurrent state (linear attention) is larger than a page: it takes a *run* of
`run_span` consecutive pages, always one aligned slab of the pool (block ids
[k * span, (k + 1) * span)). A run is handed out only from a slab whose pages are all
unreferenced; it is cached, touched and freed as one unit, and taking any of its pages
for something else evicts it whole. So checkpoints and attention blocks share one LRU, with
one bias: a single block is taken first from free pages that cache nothing and lie outside idle
slabs, so that whole slabs stay available for states.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    # The null block (id 0) stands in block tables for blocks a request no longer needs
    # (outside a sliding window); it is never handed out.
    is_null: bool = False
    # Further cache keys: an attention block that a checkpoint ends inside is also found
    # under the checkpoint's key (its pages up to there are valid).
    extra_keys: list[bytes] = field(default_factory=list)
    # The pages of the recurrent state this block belongs to (head first), on every member.
    run: list[KVBlock] | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt})"


class BlockPool:
    """`num_blocks` pages; page 0 is the null block, so `capacity` = num_blocks - 1."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        sanitize: bool = False,
        run_span: int = 1,
        max_cached_runs: int | None = None,
        on_evict: Callable[[bytes], None] | None = None,
    ):
        if num_blocks < 2:
            raise ValueError(
                f"num_kv_blocks must be >= 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.sanitize = sanitize
        self.run_span = run_span
        self.max_cached_runs = max_cached_runs
        self.on_evict = on_evict
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
        # Slabs (aligned runs of run_span pages): referenced pages in each, and those with
        # none, least recently emptied first. Slab 0 holds the null block: never idle.
        self.num_slabs = num_blocks // run_span
        self._busy = [0] * self.num_slabs
        self._busy[0] = 1
        self._idle: OrderedDict[int, None] = OrderedDict(
            (s, None) for s in range(1, self.num_slabs)
        )
        # Free pages outside idle slabs that cache nothing (in LRU order): single blocks come
        # from these first, so idle slabs stay whole for states while such pages remain.
        self._free_outside: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b)
            for b in self.blocks[1:]
            if self.slab_of(b.block_id) is None or self.slab_of(b.block_id) == 0
        )
        # Cached state runs (heads), oldest first, and how many were evicted.
        self.cached_runs: OrderedDict[int, KVBlock] = OrderedDict()
        self.num_run_evictions = 0

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_free_runs(self) -> int:
        return len(self._idle)

    def slab_of(self, block_id: int) -> int | None:
        slab = block_id // self.run_span
        return slab if slab < self.num_slabs else None

    def is_idle_slab(self, slab: int | None) -> bool:
        return slab is not None and slab in self._idle

    # -- reference counts -----------------------------------------------------------
    def _slab_pages(self, slab: int) -> list[KVBlock]:
        return self.blocks[slab * self.run_span : (slab + 1) * self.run_span]

    def _referenced(self, block: KVBlock) -> None:
        """`block` left the free queue."""
        self._free_outside.pop(block.block_id, None)
        slab = self.slab_of(block.block_id)
        if slab is not None:
            self._busy[slab] += 1
            if self._busy[slab] == 1:  # no longer idle: its free pages are fair game
                self._idle.pop(slab, None)
                for page in self._slab_pages(slab):
                    if page.ref_cnt == 0 and page is not block and not self._caches(page):
                        self._free_outside[page.block_id] = page

    def _released(self, block: KVBlock) -> None:
        """`block` joined the free queue (at its end)."""
        slab = self.slab_of(block.block_id)
        if slab is not None:
            self._busy[slab] -= 1
            if self._busy[slab] == 0:
                self._idle[slab] = None
                for page in self._slab_pages(slab):
                    self._free_outside.pop(page.block_id, None)
                return
        if not self._caches(block):
            self._free_outside[block.block_id] = block

    @staticmethod
    def _caches(block: KVBlock) -> bool:
        return block.block_hash is not None or bool(block.extra_keys) or block.run is not None

    @staticmethod
    def _units(blocks: list[KVBlock]) -> list[KVBlock]:
        """Blocks with every run head expanded to the run's pages."""
        out = []
        for block in blocks:
            if block.run is not None and block is block.run[0]:
                out += block.run
            else:
                out.append(block)
        return out

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        out = []
        for _ in range(count):
            if self._free_outside:
                block = next(iter(self._free_outside.values()))
                del self._free[block.block_id]
            else:
                _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            self._referenced(block)
            out.append(block)
        return out

    def get_new_run(self) -> KVBlock:
        """The pages of one recurrent state: the least recently emptied idle slab (its
        cached contents evicted). Returns the run's head, whose id names the state."""
        if not self._idle:
            raise RuntimeError("no run of free pages for a recurrent state")
        slab = next(iter(self._idle))
        run = self.blocks[slab * self.run_span : (slab + 1) * self.run_span]
        for block in run:
            del self._free[block.block_id]
            self._evict(block)
            block.ref_cnt = 1
            self._referenced(block)
        if self.run_span > 1:
            for block in run:
                block.run = run
        return run[0]

    def touch(self, blocks: list[KVBlock]) -> None:
        """Takes a reference on blocks (or state runs) found in the prefix cache."""
        for block in self._units(blocks):
            if block.ref_cnt == 0:
                del self._free[block.block_id]
                self._referenced(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drops a reference on each block (a run head: on its run); pass a request's blocks
        tail first so the tail of a prefix is evicted before its head."""
        for block in self._units(blocks):
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of block {block.block_id}"
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                self._released(block)
                if block.run is not None:
                    if block.run[0].block_hash is not None:
                        continue  # a cached state run stays whole and findable
                    block.run = None  # an uncached run falls apart into free pages
                if block.block_hash is None and not block.extra_keys and self.sanitize:
                    self._to_poison.append(block.block_id)

    # -- the cache ------------------------------------------------------------------
    def _evict(self, block: KVBlock) -> None:
        if block.run is not None:  # a page of a cached state run: the whole run goes
            run, head = block.run, block.run[0]
            self._uncache(head.block_hash, head)
            head.block_hash = None
            self.cached_runs.pop(head.block_id, None)
            self.num_run_evictions += 1
            self.num_evictions += 1
            for member in run:
                member.run = None
                if self.sanitize:
                    self._to_poison.append(member.block_id)
            return
        keys = ([block.block_hash] if block.block_hash is not None else []) + block.extra_keys
        if not keys:
            return
        for key in keys:
            self._uncache(key, block)
        block.block_hash = None
        block.extra_keys = []
        self.num_evictions += 1
        if self.cached_runs.pop(block.block_id, None) is not None:  # a one-page state
            self.num_run_evictions += 1
        if self.sanitize:
            self._to_poison.append(block.block_id)

    def _uncache(self, key: bytes | None, block: KVBlock) -> None:
        if key is not None and self._cached.get(key) is block:
            del self._cached[key]
            if self.on_evict is not None:
                self.on_evict(key)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Publishes a full, written block under its hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self._cached.setdefault(block_hash, block)

    def cache_extra_key(self, block: KVBlock, key: bytes) -> bool:
        """Also finds `block` under `key` (first writer wins); True if it was added."""
        if not self.enable_caching or key in self._cached:
            return False
        self._cached[key] = block
        block.extra_keys.append(key)
        return True

    def cache_run(self, head: KVBlock, key: bytes) -> bool:
        """Publishes a written state run under `key` (first writer wins); beyond
        `max_cached_runs` the oldest unreferenced cached run is evicted. True if cached."""
        if not self.enable_caching or key in self._cached or head.block_hash is not None:
            return False
        if self.max_cached_runs is not None and self.max_cached_runs <= 0:
            return False
        head.block_hash = key
        self._cached[key] = head
        self.cached_runs[head.block_id] = head
        if self.max_cached_runs is not None and len(self.cached_runs) > self.max_cached_runs:
            oldest = next((h for h in self.cached_runs.values() if h.ref_cnt == 0), None)
            if oldest is not None:
                self._evict(oldest)
        return True

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
