"""The KV-cache coordinator: one block pool, one manager per group, reconciled hits."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloom.cluster.kv_cache.block_hash import extend_block_hashes
from kvloom.cluster.kv_cache.block_pool import BlockPool, KVBlock
from kvloom.cluster.kv_cache.group_manager import FullAttentionManager, LinearStateManager
from kvloom.cluster.kv_cache.spec import FullAttentionSpec, KVCacheGroup, LinearStateSpec, MLASpec
from kvloom.cluster.request import Request


@dataclass
class CacheHit:
    blocks: list[list[KVBlock]]  # per group
    num_tokens: int = 0


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    per_group_hit_tokens: list[int] = field(default_factory=list)


def make_manager(group: KVCacheGroup, pool: BlockPool, group_id: int):
    if isinstance(group.spec, FullAttentionSpec | MLASpec):
        return FullAttentionManager(group.spec, pool, group_id)
    if isinstance(group.spec, LinearStateSpec):
        return LinearStateManager(group.spec, pool, group_id)
    raise ValueError(f"no KV-cache manager for spec {type(group.spec).__name__}")


class KVCacheCoordinator:
    def __init__(
        self,
        groups: list[KVCacheGroup],
        num_blocks: int,
        enable_caching: bool = True,
        sanitize: bool = False,
    ):
        if not groups:
            raise ValueError("a model needs at least one KV-cache group")
        self.groups = groups
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching, sanitize=sanitize)
        self.managers = [make_manager(g, self.pool, i) for i, g in enumerate(groups)]
        self.hash_block_size = groups[0].spec.block_size
        self.enable_caching = enable_caching
        self.stats = PrefixCacheStats(per_group_hit_tokens=[0] * len(groups))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def update_block_hashes(self, request: Request) -> None:
        if self.enable_caching:
            extend_block_hashes(
                request.block_hashes,
                request.all_token_ids,
                self.hash_block_size,
                request.extra_hash_key,
            )

    def find_cache_hit(self, request: Request) -> CacheHit:
        """Longest prefix every group can serve. The last token is always recomputed so
        the step that follows produces logits."""
        empty = CacheHit([[] for _ in self.managers])
        if not self.enable_caching:
            return empty
        self.update_block_hashes(request)
        max_tokens = request.num_tokens - 1
        hits = [m.find_longest_hit(request.block_hashes, max_tokens) for m in self.managers]
        num_tokens = min(len(h) * m.block_size for h, m in zip(hits, self.managers))
        hits = [m.trim_hit(h, num_tokens) for h, m in zip(hits, self.managers)]
        return CacheHit(hits, num_tokens)

    def record_hit(self, request: Request, hit: CacheHit) -> None:
        """Counts a served lookup (once per request, when it is first scheduled)."""
        self.stats.queried_tokens += request.num_tokens
        self.stats.hit_tokens += hit.num_tokens
        for i in range(self.num_groups):
            self.stats.per_group_hit_tokens[i] += hit.num_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit_blocks: list[list[KVBlock]] | None = None,
    ) -> bool:
        """Reserves blocks for the request's computed tokens (prefix-cache hits included,
        whose blocks come in `hit_blocks`) plus its new ones. Returns False, taking
        nothing, if the pool cannot hold them."""
        hit_blocks = hit_blocks or [[] for _ in self.managers]
        total = request.num_computed_tokens + num_new_tokens
        rid = request.request_id
        needed = sum(
            m.num_new_blocks_needed(rid, total, len(h)) for m, h in zip(self.managers, hit_blocks)
        )
        # Hit blocks sitting in the free queue stop being free once touched.
        reclaimed = sum(1 for h in hit_blocks for b in h if b.ref_cnt == 0)
        if needed + reclaimed > self.pool.num_free_blocks:
            return False
        for manager, blocks in zip(self.managers, hit_blocks):
            if blocks:
                manager.add_hit_blocks(rid, blocks)
            manager.allocate(rid, total)
        return True

    def publish_computed_blocks(self, request: Request) -> None:
        """Caches the request's full blocks up to its computed tokens (after the step)."""
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        for manager in self.managers:
            manager.publish_full_blocks(
                request.request_id, request.block_hashes, request.num_computed_tokens
            )

    def free(self, request: Request) -> None:
        for manager in self.managers:
            manager.free(request.request_id)

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(m.block_ids(request_id) for m in self.managers)

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks
