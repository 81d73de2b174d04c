"""The KV-cache coordinator: one block pool, one manager per group, reconciled hits.

A prefix hit is served only if every group can serve it (invariant 4). Downward-closed
groups (full attention, MLA) give an upper bound; groups that are not (sliding window,
linear-state checkpoints) pick their longest servable length at or below it; the bound
shrinks to that and the loop repeats until every group agrees. Each group is looked up
once and then only trimmed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvloom.cluster.kv_cache.block_hash import extend_block_hashes
from kvloom.cluster.kv_cache.block_pool import BlockPool, KVBlock
from kvloom.cluster.kv_cache.group_manager import (
    FullAttentionManager,
    GroupManager,
    LinearStateManager,
    SlidingWindowManager,
)
from kvloom.cluster.request import Request
from kvloom.contracts.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroup,
    LinearStateSpec,
    MLASpec,
    SlidingWindowSpec,
)


@dataclass
class CacheHit:
    blocks: list[list[KVBlock]]  # per group
    num_tokens: int = 0


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    # Per group: the tokens each group alone could have served (before reconciliation).
    per_group_hit_tokens: list[int] = field(default_factory=list)


def make_manager(group: KVCacheGroup, pool: BlockPool, group_id: int, hash_block_size: int):
    spec = group.spec
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, pool, group_id, hash_block_size)
    if isinstance(spec, FullAttentionSpec | MLASpec):
        return FullAttentionManager(spec, pool, group_id, hash_block_size)
    if isinstance(spec, LinearStateSpec):
        return LinearStateManager(spec, pool, group_id, hash_block_size)
    raise ValueError(f"no KV-cache manager for spec {type(spec).__name__}")


@dataclass
class StateCopies:
    """Page copies the workers run for linear-state groups: `before` the forward (a hit's
    checkpoint into the new live page), `after` it (the live state into a checkpoint)."""

    before: list[tuple[int, int]] = field(default_factory=list)
    after: list[tuple[int, int]] = field(default_factory=list)


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
        self.hash_block_size = math.gcd(*(g.spec.block_size for g in groups))
        self.managers: list[GroupManager] = [
            make_manager(g, self.pool, i, self.hash_block_size) for i, g in enumerate(groups)
        ]
        # Hits land on boundaries valid for every group's block size.
        self.hit_alignment = math.lcm(*(g.spec.block_size for g in groups))
        self.enable_caching = enable_caching
        self.stats = PrefixCacheStats(per_group_hit_tokens=[0] * len(groups))
        # Per request, so a request preempted or freed before its step runs takes its
        # copies with it (its pages may be handed to someone else in the same schedule).
        self.copies: dict[str, StateCopies] = {}

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def linear_block_size(self) -> int | None:
        """Block size at which linear-state checkpoints are cached (align mode), if any."""
        sizes = [m.block_size for m in self.managers if isinstance(m, LinearStateManager)]
        return max(sizes) if sizes and self.enable_caching else None

    def update_block_hashes(self, request: Request) -> None:
        if self.enable_caching:
            extend_block_hashes(
                request.block_hashes,
                request.all_token_ids,
                self.hash_block_size,
                request.extra_hash_key,
            )

    # -- lookup ---------------------------------------------------------------------
    def find_cache_hit(self, request: Request) -> CacheHit:
        """Longest prefix every group can serve. The last token is always recomputed so
        the step that follows produces logits."""
        if not self.enable_caching:
            return CacheHit([[] for _ in self.managers])
        self.update_block_hashes(request)
        max_tokens = request.num_tokens - 1
        hits = [m.find_longest_hit(request.block_hashes, max_tokens) for m in self.managers]
        self._last_group_lengths = [
            m.hit_length_at_most(h, max_tokens) for m, h in zip(self.managers, hits)
        ]
        length = self.reconcile(hits, max_tokens)
        return CacheHit([m.trim_hit(h, length) for m, h in zip(self.managers, hits)], length)

    def reconcile(self, hits: list[list[KVBlock]], max_tokens: int) -> int:
        length = max_tokens // self.hit_alignment * self.hit_alignment
        while length > 0:
            agreed = length
            for manager, hit in zip(self.managers, hits):
                agreed = min(agreed, manager.hit_length_at_most(hit, agreed))
            agreed = agreed // self.hit_alignment * self.hit_alignment
            if agreed == length:
                break
            length = agreed
        return length

    def record_hit(self, request: Request, hit: CacheHit) -> None:
        """Counts a served lookup (once per request, when it is first scheduled)."""
        self.stats.queried_tokens += request.num_tokens
        self.stats.hit_tokens += hit.num_tokens
        for i, length in enumerate(getattr(self, "_last_group_lengths", [0] * self.num_groups)):
            self.stats.per_group_hit_tokens[i] += length

    # -- allocation -----------------------------------------------------------------
    @property
    def has_linear_groups(self) -> bool:
        return any(isinstance(m, LinearStateManager) for m in self.managers)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit_blocks: list[list[KVBlock]] | None = None,
        num_draft_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Reserves blocks for the request's computed tokens (prefix-cache hits included,
        whose blocks come in `hit_blocks`), its `num_new_tokens` real tokens, the draft
        tokens verified with them and lookahead slots for a drafter. Linear-state groups
        also get a checkpoint page when a draft-free step ends on their block boundary, and
        a backup of the live state before a step with drafts (restored if any draft is
        rejected). Returns False, taking nothing, if the pool cannot hold it all."""
        hit_blocks = hit_blocks or [[] for _ in self.managers]
        computed = request.num_computed_tokens
        real_end = computed + num_new_tokens
        total = real_end + num_draft_tokens + num_lookahead_tokens
        rid = request.request_id
        needed = 0
        for manager, hit in zip(self.managers, hit_blocks):
            needed += manager.num_new_blocks_needed(rid, total, len(hit))
            if isinstance(manager, LinearStateManager):
                if num_draft_tokens == 0 and manager.checkpoint_needed(real_end):
                    needed += 1
                if num_draft_tokens and not manager.has_backup(rid):
                    needed += 1
        # Hit blocks sitting in the free queue stop being free once touched.
        needed += len({b.block_id for h in hit_blocks for b in h if b.ref_cnt == 0})
        if needed > self.pool.num_free_blocks:
            return False
        for manager, blocks in zip(self.managers, hit_blocks):
            if blocks:
                manager.add_hit_blocks(rid, blocks)
            manager.allocate(rid, total, computed)
            if isinstance(manager, LinearStateManager):
                live = manager.live_page(rid).block_id
                copies = self.copies.setdefault(rid, StateCopies())
                if blocks:
                    copies.before.append((blocks[-1].block_id, live))
                if num_draft_tokens:
                    copies.before.append((live, manager.backup_page(rid).block_id))
                elif manager.checkpoint_needed(real_end):
                    page = manager.take_checkpoint_page(rid, real_end)
                    copies.after.append((live, page.block_id))
        return True

    def restore_state(self, request: Request) -> None:
        """Before the next step: the live state goes back to its pre-draft backup."""
        for manager in self.managers:
            if isinstance(manager, LinearStateManager) and manager.has_backup(request.request_id):
                live = manager.live_page(request.request_id).block_id
                backup = manager.backup_page(request.request_id).block_id
                self.copies.setdefault(request.request_id, StateCopies()).before.append(
                    (backup, live)
                )

    def drain_copies(self, request_ids) -> StateCopies:
        """The state copies of this step's scheduled requests, in schedule order."""
        out = StateCopies()
        for rid in request_ids:
            copies = self.copies.pop(rid, None)
            if copies is not None:
                out.before += copies.before
                out.after += copies.after
        return out

    def publish_computed_blocks(self, request: Request) -> None:
        """After the step: caches full written blocks and finished checkpoints."""
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        for manager in self.managers:
            manager.publish_full_blocks(
                request.request_id, request.block_hashes, request.num_computed_tokens
            )

    def free(self, request: Request) -> None:
        self.copies.pop(request.request_id, None)
        for manager in self.managers:
            manager.free(request.request_id)

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(m.block_ids(request_id) for m in self.managers)

    def new_block_ids(self, request_id: str, sent: list[int]) -> tuple[list[int], ...]:
        """Per group, the block ids after the first sent[g] (the workers have those)."""
        return tuple(m.block_ids(request_id, n) for m, n in zip(self.managers, sent))

    def num_blocks(self, request_id: str) -> list[int]:
        return [m.num_blocks(request_id) for m in self.managers]

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.capacity
