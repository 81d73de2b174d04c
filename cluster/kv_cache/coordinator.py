"""The KV-cache coordinator: one block pool, one manager per group, reconciled hits.

A prefix hit is served only if every group can serve it (invariant 4). Each group says
the longest length at or below a bound that it can serve (full attention: whole blocks,
or a length where an entry ends inside a block; sliding window: one whose window blocks
are cached; linear state: a checkpoint at exactly that length); the bound shrinks to the
smallest answer and the loop repeats until every group agrees, at token granularity.
Each group is looked up once and then only trimmed.

Linear-state checkpoints (docs/kv_cache_pages.md) are decided here: when a request ends
(finished, aborted or preempted) its live state is published as the checkpoint at its
computed length; a step that ends one token before a prompt's end (the scheduler cuts
the prefill there), or on a checkpoint interval, copies the live state into a fresh run
after its forward. A checkpoint is keyed by the prefix
it holds (checkpoint_keys.py), and the attention block it ends inside is published under
the same key, so the hit is exact at any length. None is taken from draft positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvloom.cluster.kv_cache.block_hash import extend_block_hashes
from kvloom.cluster.kv_cache.block_pool import BlockPool, KVBlock
from kvloom.cluster.kv_cache.checkpoint_keys import CheckpointIndex, prefix_key
from kvloom.cluster.kv_cache.group_manager import (
    FullAttentionManager,
    GroupHit,
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
    # Requests whose hit started from a linear-state checkpoint.
    checkpoint_hits: int = 0


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
    """Pool page copies the workers run: `before` the forward (a hit's checkpoint into the
    new live state, the block a hit ends inside into a fresh block, a draft backup),
    `after` it (the live state into a checkpoint). A state run is listed page by page."""

    before: list[tuple[int, int]] = field(default_factory=list)
    after: list[tuple[int, int]] = field(default_factory=list)


class KVCacheCoordinator:
    def __init__(
        self,
        groups: list[KVCacheGroup],
        num_blocks: int,
        enable_caching: bool = True,
        sanitize: bool = False,
        checkpoint_interval: int = 0,
        max_checkpoints: int | None = None,
        bytes_per_block: int = 0,
    ):
        if not groups:
            raise ValueError("a model needs at least one KV-cache group")
        self.groups = groups
        self.hash_block_size = math.gcd(*(g.spec.block_size for g in groups))
        spans = {g.spec.pages_per_state for g in groups if isinstance(g.spec, LinearStateSpec)}
        if len(spans) > 1:
            raise ValueError(f"linear-state groups span different page counts: {sorted(spans)}")
        span = spans.pop() if spans else 1
        num_linear = sum(isinstance(g.spec, LinearStateSpec) for g in groups)
        cap = None
        if num_linear:
            # None: checkpoints may fill up to half the pool's state runs.
            if max_checkpoints is None:
                cap = (num_blocks // span) // 2
            else:
                cap = max_checkpoints * num_linear
        if checkpoint_interval and checkpoint_interval % self.hash_block_size:
            raise ValueError(
                f"linear_state_checkpoint_interval must be a multiple of block_size "
                f"{self.hash_block_size}, got {checkpoint_interval}"
            )
        self.index = CheckpointIndex(self.hash_block_size)
        self.pool = BlockPool(
            num_blocks,
            enable_caching=enable_caching,
            sanitize=sanitize,
            run_span=span,
            max_cached_runs=cap,
            on_evict=self.index.discard,
        )
        self.managers: list[GroupManager] = [
            make_manager(g, self.pool, i, self.hash_block_size) for i, g in enumerate(groups)
        ]
        self.linear = [m for m in self.managers if isinstance(m, LinearStateManager)]
        self.attention = [m for m in self.managers if isinstance(m, FullAttentionManager)]
        # Plain full attention only (no window to slide, no state): a step whose blocks
        # already cover its tokens needs nothing from allocate_slots.
        self._plain_attention = all(type(m) is FullAttentionManager for m in self.managers)
        self.enable_caching = enable_caching
        self.checkpoints_on = enable_caching and bool(self.linear) and cap != 0
        self.checkpoint_interval = checkpoint_interval if self.checkpoints_on else 0
        self.bytes_per_block = bytes_per_block
        self.stats = PrefixCacheStats(per_group_hit_tokens=[0] * len(groups))
        # Per request, so a request preempted or freed before its step runs takes its
        # copies with it (its pages may be handed to someone else in the same schedule).
        self.copies: dict[str, StateCopies] = {}
        # Lengths the live state (and the draft backup) hold once the steps handed to the
        # workers have run: a request's state is published only where it is known exact.
        self._planned: dict[str, tuple[int, int | None]] = {}
        self.state_len: dict[str, int] = {}
        self.backup_len: dict[str, int] = {}
        # request id -> [(length, [checkpoint run per linear group])] awaiting their step
        self.pending: dict[str, list[tuple[int, list[KVBlock]]]] = {}
        # request id -> computed length below which publish_computed_blocks has no work
        self._publish_due: dict[str, int] = {}

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

    def prefix_key(self, request: Request, length: int) -> bytes:
        return prefix_key(
            request.block_hashes,
            request.all_token_ids,
            length,
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
        ends = self.index.lengths(
            request.block_hashes, request.all_token_ids, max_tokens, request.extra_hash_key
        )
        hits = [m.find_longest_hit(request.block_hashes, max_tokens, ends) for m in self.managers]
        self._last_group_lengths = [
            m.hit_length_at_most(h, max_tokens) for m, h in zip(self.managers, hits)
        ]
        length = self.reconcile(hits, max_tokens)
        return CacheHit([m.trim_hit(h, length) for m, h in zip(self.managers, hits)], length)

    def no_hit(self) -> CacheHit:
        return CacheHit([[] for _ in self.managers])

    def reconcile(self, hits: list[GroupHit], max_tokens: int) -> int:
        """The fixed point of 'every group's longest servable length at or below L'."""
        length = max_tokens
        while length > 0:
            agreed = min(m.hit_length_at_most(h, length) for m, h in zip(self.managers, hits))
            if agreed == length:
                break
            length = agreed
        return max(length, 0)

    def record_hit(self, request: Request, hit: CacheHit) -> None:
        """Counts a served lookup (once per request, when it is first scheduled)."""
        self.stats.queried_tokens += request.num_tokens
        self.stats.hit_tokens += hit.num_tokens
        for i, length in enumerate(getattr(self, "_last_group_lengths", [0] * self.num_groups)):
            self.stats.per_group_hit_tokens[i] += length
        if hit.num_tokens and self.linear:
            self.stats.checkpoint_hits += 1

    # -- allocation -----------------------------------------------------------------
    @property
    def has_linear_groups(self) -> bool:
        return bool(self.linear)

    def prompt_checkpoint_length(self, request: Request) -> int | None:
        """Where a prompt's prefill keeps a checkpoint: one token before its end, the longest
        hit the same prompt can take again (its last token is always recomputed), so the
        scheduler ends a prefill chunk there."""
        length = request.num_prompt_tokens - 1
        return length if self.checkpoints_on and length > 0 else None

    def _checkpoint_wanted(self, request: Request, computed: int, real_end: int, drafts: int):
        """A draft-free step that ends one token before the prompt's end or on a checkpoint
        interval keeps a checkpoint (unless every group already has one there)."""
        if not self.checkpoints_on or drafts or real_end <= computed:
            return False
        interval = self.checkpoint_interval
        at_interval = interval and real_end % interval == 0
        if real_end != self.prompt_checkpoint_length(request) and not at_interval:
            return False
        if real_end > request.num_tokens:
            return False
        self.update_block_hashes(request)
        key = self.prefix_key(request, real_end)
        return any(self.pool.lookup(m.tag + key) is None for m in self.linear)

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
        get a live state run, a checkpoint run when the step keeps one, and a backup of
        the live state before a step with drafts (restored if any draft is rejected).
        Returns False, taking nothing, if the pool cannot hold it all."""
        if hit_blocks is None and self._plain_attention:
            # Most decode steps: the request's blocks hold the new tokens already.
            rid = request.request_id
            total = (
                request.num_computed_tokens + num_new_tokens + num_draft_tokens
                + num_lookahead_tokens
            )  # fmt: skip
            for manager in self.managers:
                if len(manager.req_blocks.get(rid, ())) * manager.block_size < total:
                    break
            else:
                return True
        hit_blocks = hit_blocks or [[] for _ in self.managers]
        computed = request.num_computed_tokens
        hit_tokens = computed if any(hit_blocks) else 0
        real_end = computed + num_new_tokens
        total = real_end + num_draft_tokens + num_lookahead_tokens
        rid = request.request_id
        checkpoint = self._checkpoint_wanted(request, computed, real_end, num_draft_tokens)
        blocks = runs = 0
        for manager in self.managers:
            if isinstance(manager, LinearStateManager):
                runs += manager.num_new_runs(rid, False, num_draft_tokens > 0)
            else:
                blocks += manager.num_new_blocks_needed(rid, total, hit_tokens)
        # Hit blocks sitting in the free queue stop being free once touched (and their
        # slabs can no longer give a state run).
        touched = {b.block_id for h in hit_blocks for b in self.pool._units(h) if b.ref_cnt == 0}
        slabs = {self.pool.slab_of(i) for i in touched}
        free_runs = self.pool.num_free_runs - sum(map(self.pool.is_idle_slab, slabs))
        span = self.pool.run_span

        def fits(runs: int) -> bool:
            pages = blocks + runs * span + len(touched)
            return runs <= free_runs and pages <= self.pool.num_free_blocks

        if not fits(runs):
            return False
        # A checkpoint is a bonus: under pressure the step goes without it.
        checkpoint = checkpoint and fits(runs + len(self.linear))
        if checkpoint or any(hit_blocks):
            # What a hit holds is released, and a checkpoint published, after the step.
            self._publish_due.pop(rid, None)
        for manager, hit in zip(self.managers, hit_blocks):
            if hit:
                manager.add_hit_blocks(rid, hit, hit_tokens)
        copies = self.copies.setdefault(rid, StateCopies())
        # State runs first: attention blocks taken before them could break up the slabs.
        for manager in self.linear:
            manager.allocate(rid, total, computed)
            live = manager.live_page(rid)
            source = manager.pending_hit_source.get(rid) if hit_blocks[manager.group_id] else None
            if source is not None:
                copies.before += manager.page_pairs(source, live)
            if num_draft_tokens:
                copies.before += manager.page_pairs(live, manager.backup_page(rid))
        if checkpoint:
            runs_taken = [m.new_run() for m in self.linear]
            for manager, page in zip(self.linear, runs_taken):
                copies.after += manager.page_pairs(manager.live_page(rid), page)
            self.pending.setdefault(rid, []).append((real_end, runs_taken))
        for manager in self.attention:
            manager.allocate(rid, total, computed)
            copies.before += manager.take_copies(rid)
        if self.linear:
            self._planned[rid] = (
                real_end + num_draft_tokens,
                computed if num_draft_tokens else None,
            )
        return True

    def restore_state(self, request: Request) -> None:
        """Before the next step: the live state goes back to its pre-draft backup."""
        for manager in self.linear:
            if manager.has_backup(request.request_id):
                live = manager.live_page(request.request_id)
                backup = manager.backup_page(request.request_id)
                self.copies.setdefault(
                    request.request_id, StateCopies()
                ).before += manager.page_pairs(backup, live)

    def drain_copies(self, request_ids) -> StateCopies:
        """The page copies of this step's scheduled requests, in schedule order; their
        steps are now handed to the workers."""
        out = StateCopies()
        for rid in request_ids:
            copies = self.copies.pop(rid, None)
            if copies is not None:
                out.before += copies.before
                out.after += copies.after
            planned = self._planned.pop(rid, None)
            if planned is not None:
                self.state_len[rid] = planned[0]
                if planned[1] is not None:
                    self.backup_len[rid] = planned[1]
        return out

    def publish_computed_blocks(self, request: Request) -> None:
        """After the step: caches full written blocks and the checkpoints taken by steps
        that have run."""
        if not self.enable_caching:
            return
        rid = request.request_id
        if request.num_computed_tokens < self._publish_due.get(rid, 0):
            return  # no block filled since the last publish and nothing waits: most steps
        self.update_block_hashes(request)
        for manager in self.managers:
            manager.publish_full_blocks(rid, request.block_hashes, request.num_computed_tokens)
        waiting = []
        for length, runs in self.pending.pop(request.request_id, ()):
            if length <= min(request.num_computed_tokens, request.num_tokens):
                self._publish_checkpoint(request, length, runs)
                for run in runs:
                    self.pool.free_blocks([run])
            else:
                waiting.append((length, runs))
        if waiting:
            self.pending[rid] = waiting
        dues = [m.publish_due(rid) for m in self.managers]
        self._publish_due[rid] = 0 if waiting or None in dues else min(dues)

    def _publish_checkpoint(self, request: Request, length: int, runs: list[KVBlock]) -> None:
        """Caches the state runs (one per linear group) as the checkpoint at `length`, and
        the blocks `length` ends inside under the same key."""
        key = self.prefix_key(request, length)
        tagged = [m.cache_state(run, key) for m, run in zip(self.linear, runs)]
        tagged += [m.cache_end(request.request_id, length, key) for m in self.attention]
        for t in tagged:
            if t is not None:
                self.index.add(t, request.block_hashes, length, request.extra_hash_key)

    def _checkpoint_at_free(self, request: Request) -> None:
        """The live state of a request that ends (or is preempted) becomes the checkpoint
        at its computed length, if the steps handed out leave it exactly there and every
        token before it is known. Else (drafts rejected, or accepted past a stop and
        dropped) the draft backup is, at the length it was taken."""
        if not self.checkpoints_on:
            return
        rid = request.request_id
        candidates = []
        if not getattr(request, "restore_state", False):
            live = [m.req_blocks.get(rid, [None])[0] for m in self.linear]
            if self.state_len.get(rid) == request.num_computed_tokens:
                candidates.append((request.num_computed_tokens, live))
        if rid in self.backup_len:
            candidates.append((self.backup_len[rid], [m.backups.get(rid) for m in self.linear]))
        for length, runs in candidates:
            if 0 < length <= request.num_tokens and all(run is not None for run in runs):
                self.update_block_hashes(request)
                self._publish_checkpoint(request, length, runs)
                return

    def free(self, request: Request) -> None:
        rid = request.request_id
        self._publish_due.pop(rid, None)
        self.copies.pop(rid, None)
        self._checkpoint_at_free(request)
        self._planned.pop(rid, None)
        self.state_len.pop(rid, None)
        self.backup_len.pop(rid, None)
        for _, runs in self.pending.pop(rid, ()):
            self.pool.free_blocks(runs)  # never published
        for manager in self.managers:
            manager.free(rid)

    def checkpoint_stats(self) -> dict[str, int]:
        """Linear-state checkpoints: runs kept now (one per state group and checkpoint),
        requests served from one, runs evicted, and the bytes kept."""
        kept = len(self.pool.cached_runs)
        return {
            "linear_state_checkpoints_kept": kept,
            "linear_state_checkpoints_hit": self.stats.checkpoint_hits,
            "linear_state_checkpoints_evicted": self.pool.num_run_evictions,
            "linear_state_checkpoint_bytes": kept * self.pool.run_span * self.bytes_per_block,
        }

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
