"""The KV-cache plan: from the specs the workers report to groups, block size and pages.

The control plane makes every choice here, once (as vLLM's engine core does), and hands
the workers the plan (contracts/kv_cache_plan.py); a worker allocates what it says.

The one block pool maps onto device memory so memory really flows between groups: a pool
block id names one page in each of `num_buffers` shared buffers. Layer i of every
KV-cache group views buffer i, so a block holds attention KV while an attention group owns
it and a linear-attention state while a state group owns it, never both. For that:

- groups are cut to (about) the same number of layers: an 18-layer Gated DeltaNet group
  beside a 6-layer attention group becomes three 6-layer groups, each with its own block
  per request (a request then owns 3 state blocks and its attention blocks);
- every page is as large as the largest page any group needs. A model with recurrent
  state (megabytes per layer and request) sizes its attention blocks so that one attention
  page is about one state page, unless the user fixed `block_size` (then attention pages
  are padded, and a warning says how much is wasted).

Drafter layers keep pages of their own (their layer count and sizes are unrelated).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

from kvloom.contracts.config import CacheConfig, SchedulerConfig
from kvloom.contracts.kv_cache_plan import KVCacheMemory, KVCachePlan, KVCacheSpecs, PageLayout
from kvloom.contracts.kv_cache_spec import (
    PAGE_ALIGN,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    LinearStateSpec,
    SlidingWindowSpec,
)

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
# Attention block sizes chosen to match a state page are multiples of this.
BLOCK_SIZE_QUANTUM = 16


def align_up(n: int, to: int) -> int:
    return -(-n // to) * to


def rank_page_bytes(spec: KVCacheSpec, dcp_size: int) -> int:
    """A page's bytes on one rank: attention KV is split over the DCP ranks by token."""
    if isinstance(spec, LinearStateSpec):
        return spec.page_size_bytes
    return spec.page_size_bytes // dcp_size


def has_state_and_tokens(specs: dict) -> bool:
    kinds = {isinstance(s, LinearStateSpec) for s in specs.values()}
    return kinds == {True, False}


def with_block_size(specs: dict, block_size: int) -> dict:
    """The specs at `block_size` tokens per block."""
    return {key: replace(spec, block_size=block_size) for key, spec in specs.items()}


def with_linear_state_dtype(specs: dict, cache: CacheConfig, model_dtype: str) -> dict:
    """Applies `linear_state_dtype` to the recurrent state of linear-attention layers
    ("float32" keeps the layers' own choice: float32, or float64 for float64 models)."""
    setting = cache.linear_state_dtype
    if setting == "float32":
        return specs
    state_dtype = model_dtype if setting == "auto" else setting
    return {
        name: replace(spec, state_dtype=state_dtype) if isinstance(spec, LinearStateSpec) else spec
        for name, spec in specs.items()
    }


def book_sliding_windows(specs: dict, cache: CacheConfig) -> dict:
    """Applies `sliding_window_booking`: sliding-window layers booked as full attention
    keep every block (their window still applies at compute)."""
    booking = cache.sliding_window_booking
    if booking == "auto":
        all_sliding = all(isinstance(s, SlidingWindowSpec) for s in specs.values())
        booking = "full" if all_sliding and cache.enable_prefix_caching else "window"
    if booking == "window":
        return specs
    return {
        layer: FullAttentionSpec(s.block_size, s.num_kv_heads, s.head_size, s.dtype)
        if isinstance(s, SlidingWindowSpec)
        else s
        for layer, s in specs.items()
    }


def group_layers(layer_specs: dict[str, KVCacheSpec]) -> list[KVCacheGroup]:
    """Layers with equal specs share a group (and a block table per request)."""
    groups: list[KVCacheGroup] = []
    for name, spec in layer_specs.items():
        for group in groups:
            if group.spec == spec:
                group.layer_names.append(name)
                break
        else:
            groups.append(KVCacheGroup(spec, [name]))
    return groups


def block_size_for_state_pages(specs: dict, block_size: int, dcp_size: int) -> int:
    """The smallest block size (a multiple of BLOCK_SIZE_QUANTUM × dcp_size) at which every
    token-paged layer's page holds at least one state page. `specs` were built with
    `block_size` tokens per block."""
    state_page = max(s.page_size_bytes for s in specs.values() if isinstance(s, LinearStateSpec))
    quantum = BLOCK_SIZE_QUANTUM * dcp_size
    best = quantum
    for spec in specs.values():
        if isinstance(spec, LinearStateSpec):
            continue
        per_token = rank_page_bytes(spec, dcp_size) / block_size
        best = max(best, align_up(math.ceil(state_page / per_token), quantum))
    return best


def split_groups(groups: list[KVCacheGroup]) -> list[KVCacheGroup]:
    """Groups cut to one size, so layer i of every group can share buffer i. The size is
    the smallest group's layer count, or the largest one's when padding every group up to
    it wastes less than a quarter (as vLLM's hybrid allocator chooses)."""
    if len(groups) < 2:
        return groups
    counts = [len(g.layer_names) for g in groups]
    size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
    out = []
    for group in groups:
        names = group.layer_names
        out += [KVCacheGroup(group.spec, names[i : i + size]) for i in range(0, len(names), size)]
    return out


def plan_layout(groups: list[KVCacheGroup], dcp_size: int) -> PageLayout:
    """Shared buffers for `groups` (cut to one size): layer i of every group views buffer
    i, whose pages are as large as the largest page any group needs."""
    page = max(rank_page_bytes(g.spec, dcp_size) for g in groups)
    buffer_of = {}
    for group in groups:
        for i, layer in enumerate(group.layer_names):
            buffer_of[layer] = i
    num_buffers = max(len(g.layer_names) for g in groups)
    return PageLayout(align_up(page, PAGE_ALIGN), num_buffers, buffer_of)


def padding_fraction(layout: PageLayout, groups: list[KVCacheGroup], dcp_size: int) -> float:
    """Share of the shared pages that `groups` (those laid out on them) leave unused."""
    used = sum(rank_page_bytes(g.spec, dcp_size) * len(g.layer_names) for g in groups)
    return 1.0 - used / (layout.page_bytes * layout.num_buffers * len(groups))


def resolve_block_size(
    build_specs, requested: int | None, dcp_size: int
) -> tuple[dict[object, KVCacheSpec], int]:
    """Specs at the block size to use, and that size. `build_specs(n)` returns the model's
    specs at n tokens per block (per rank n / dcp_size). `requested` None means automatic:
    16, or for a model with recurrent state the size at which attention and state pages
    match (logged, since it differs from the usual 16)."""
    size = (requested or DEFAULT_BLOCK_SIZE) * dcp_size
    specs = build_specs(size)
    if not has_state_and_tokens(specs):
        return specs, size
    matched = block_size_for_state_pages(specs, size, dcp_size)
    if requested is None:
        if matched != size:
            logger.info(
                "block_size set to %d tokens so an attention page holds as much as one "
                "recurrent-state page (set block_size to override)",
                matched // dcp_size,
            )
            specs = build_specs(matched)
        return specs, matched
    used = min(1.0, size / matched)
    if used < 0.5:
        logger.warning(
            "block_size %d: attention pages use %.0f%% of the shared page a recurrent state "
            "needs; leave block_size unset (automatic: %d) to waste none",
            requested,
            100 * used,
            matched // dcp_size,
        )
    return specs, size


def plan_kv_cache(
    reported: KVCacheSpecs, cache: CacheConfig, model_dtype: str, dcp_size: int = 1
) -> KVCachePlan:
    """The plan for the workers' caches, from the specs they report: the cache settings
    applied (`linear_state_dtype`, `sliding_window_booking`), the block size resolved
    (`resolve_block_size`), the target model's groups cut to one size and laid out on
    shared buffers, the drafter's layers added with private pages. With DCP a pool block
    spans dcp_size ranks: block_size / dcp_size tokens on each."""
    clash = reported.target.keys() & reported.draft.keys()
    if clash:
        raise ValueError(f"KV-cache specs: drafter layer keys {sorted(clash)} clash")
    specs, block_size = resolve_block_size(
        lambda n: with_linear_state_dtype(with_block_size(reported.target, n), cache, model_dtype),
        cache.block_size,
        dcp_size,
    )
    target = book_sliding_windows(specs, cache)
    # Booked on its own: an all-sliding drafter is cached as full attention.
    draft = book_sliding_windows(
        with_linear_state_dtype(
            with_block_size(reported.draft, block_size // dcp_size), cache, model_dtype
        ),
        cache,
    )
    groups = split_groups(group_layers(target))
    layout = plan_layout(groups, dcp_size)
    padding = padding_fraction(layout, groups, dcp_size)
    if padding > 0.5:
        logger.warning(
            "%.0f%% of each KV-cache block is padding (groups: %s)",
            100 * padding,
            ", ".join(f"{type(g.spec).__name__}×{len(g.layer_names)}" for g in groups),
        )
    # A drafter layer shares the block ids of the first target group with its spec (its
    # pages are its own), else it gets a group of its own.
    for key, spec in draft.items():
        group = next((g for g in groups if g.spec == spec), None)
        if group is None:
            group = KVCacheGroup(spec, [])
            groups.append(group)
        group.layer_names.append(key)
        layout.private_page_bytes[key] = align_up(rank_page_bytes(spec, dcp_size), PAGE_ALIGN)
    return KVCachePlan(block_size, groups, layout)


def num_blocks_for_memory(plan: KVCachePlan, memory: KVCacheMemory, sched: SchedulerConfig) -> int:
    """Pool blocks that fit the memory a worker reported, capped at what every sequence
    could hold at full length (more would sit unused). Raises if fewer than 2 fit."""
    useful = sched.max_num_seqs * sum(
        -(-sched.max_model_len // g.spec.block_size) for g in plan.groups
    )
    num_blocks = min(memory.available_bytes // plan.bytes_per_block, useful)
    if num_blocks < 2:
        raise ValueError(
            f"the model does not fit: no room for the KV cache ({memory.source}; one block "
            f"needs {plan.bytes_per_block} bytes). Raise gpu_memory_utilization, lower "
            "max_num_batched_tokens / max_num_seqs, use more tensor-parallel ranks, or set "
            "kv_cache_memory_bytes / num_kv_blocks"
        )
    return num_blocks
