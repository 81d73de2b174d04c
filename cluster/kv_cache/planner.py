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
- a page is as large as the largest attention (or MLA) page at the block size (16
  tokens unless set); a recurrent state (megabytes per layer and request) spans that many
  consecutive pages (`pages_for_state`), so attention keeps fine-grained blocks and no
  page is padded to a state's size.

Drafter layers keep pages of their own (their layer count and sizes are unrelated).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kvloom.contracts.config import CacheConfig, SchedulerConfig
from kvloom.contracts.kv_cache_plan import KVCacheMemory, KVCachePlan, KVCacheSpecs, PageLayout
from kvloom.contracts.kv_cache_spec import (
    FP8_KV_DTYPE,
    PAGE_ALIGN,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    LinearStateSpec,
    SlidingWindowSpec,
)

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16


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


def with_kv_cache_dtype(specs: dict, cache: CacheConfig) -> dict:
    """Applies `kv_cache_dtype` to attention pages (full, sliding-window, MLA): "fp8"
    stores them as float8_e4m3fn, one byte per element; linear state is left alone."""
    if cache.kv_cache_dtype == "auto":
        return specs
    return {
        name: spec if isinstance(spec, LinearStateSpec) else replace(spec, dtype=FP8_KV_DTYPE)
        for name, spec in specs.items()
    }


def cache_dtypes(specs: dict, cache: CacheConfig, model_dtype: str) -> dict:
    """The reported specs with the cache dtype settings applied."""
    return with_kv_cache_dtype(with_linear_state_dtype(specs, cache, model_dtype), cache)


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
    i. A page is as large as the largest token-paged (attention, MLA) page; a recurrent
    state spans `pages_for_state` consecutive pages. A model of state groups only gets
    pages of one state each."""
    token_pages = [rank_page_bytes(g.spec, dcp_size) for g in groups if not is_state(g)]
    page = max(token_pages or [rank_page_bytes(g.spec, dcp_size) for g in groups])
    buffer_of = {}
    for group in groups:
        for i, layer in enumerate(group.layer_names):
            buffer_of[layer] = i
    num_buffers = max(len(g.layer_names) for g in groups)
    return PageLayout(align_up(page, PAGE_ALIGN), num_buffers, buffer_of)


def is_state(group: KVCacheGroup) -> bool:
    return isinstance(group.spec, LinearStateSpec)


def pages_for_state(groups: list[KVCacheGroup], page_bytes: int, dcp_size: int) -> int:
    """Consecutive pool pages one recurrent state spans (the same for every state group,
    so the pool hands out runs of one length)."""
    states = [rank_page_bytes(g.spec, dcp_size) for g in groups if is_state(g)]
    return max([-(-b // page_bytes) for b in states], default=1)


def padding_fraction(layout: PageLayout, groups: list[KVCacheGroup], dcp_size: int) -> float:
    """Share of the shared pages that `groups` (those laid out on them) leave unused."""
    span = pages_for_state(groups, layout.page_bytes, dcp_size)
    used = held = 0
    for g in groups:
        pages = span if is_state(g) else 1
        used += rank_page_bytes(g.spec, dcp_size) * len(g.layer_names)
        held += layout.page_bytes * layout.num_buffers * pages
    return 1.0 - used / held


def resolve_block_size(
    build_specs, requested: int | None, dcp_size: int
) -> tuple[dict[object, KVCacheSpec], int]:
    """Specs at the block size to use, and that size: the one requested, else 16 (per
    DCP rank), hybrids included. `build_specs(n)` returns the model's specs at n tokens
    per block (per rank n / dcp_size). The block size is never changed behind the user's
    back: a recurrent state spans several small pages instead (`pages_for_state`)."""
    size = (requested or DEFAULT_BLOCK_SIZE) * dcp_size
    return build_specs(size), size


def plan_kv_cache(
    reported: KVCacheSpecs, cache: CacheConfig, model_dtype: str, dcp_size: int = 1
) -> KVCachePlan:
    """The plan for the workers' caches, from the specs they report: the cache settings
    applied (`linear_state_dtype`, `kv_cache_dtype`, `sliding_window_booking`), the block
    size resolved (`resolve_block_size`), the target model's groups cut to one size and
    laid out on shared buffers, the drafter's layers added with private pages. With DCP a
    pool block spans dcp_size ranks: block_size / dcp_size tokens on each."""
    clash = reported.target.keys() & reported.draft.keys()
    if clash:
        raise ValueError(f"KV-cache specs: drafter layer keys {sorted(clash)} clash")
    specs, block_size = resolve_block_size(
        lambda n: cache_dtypes(with_block_size(reported.target, n), cache, model_dtype),
        cache.block_size,
        dcp_size,
    )
    target = book_sliding_windows(specs, cache)
    # Booked on its own: an all-sliding drafter is cached as full attention.
    draft = book_sliding_windows(
        cache_dtypes(with_block_size(reported.draft, block_size // dcp_size), cache, model_dtype),
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
    # pages are its own, each a whole state for a state layer), else it gets a group of
    # its own.
    for key, spec in draft.items():
        group = next((g for g in groups if g.spec == spec), None)
        if group is None:
            group = KVCacheGroup(spec, [])
            groups.append(group)
        group.layer_names.append(key)
        layout.private_page_bytes[key] = align_up(rank_page_bytes(spec, dcp_size), PAGE_ALIGN)
    span = pages_for_state(groups, layout.page_bytes, dcp_size)
    for group in groups:
        if is_state(group):
            group.spec = replace(group.spec, pages_per_state=span)
    return KVCachePlan(block_size, groups, layout)


def slack_bytes(plan: KVCachePlan) -> int:
    """Pages after the last block of each shared buffer, so a state starting at the last
    block ids still has all its pages (workers/cache_pages.span_view)."""
    span = max(
        (g.spec.pages_per_state for g in plan.groups if isinstance(g.spec, LinearStateSpec)),
        default=1,
    )
    return (span - 1) * plan.layout.page_bytes * plan.layout.num_buffers


def num_blocks_for_memory(plan: KVCachePlan, memory: KVCacheMemory, sched: SchedulerConfig) -> int:
    """Pool blocks that fit the memory a worker reported, capped at what every sequence
    could hold at full length (more would sit unused). Raises if fewer than 2 fit."""
    # A state group holds a live state, a draft backup and checkpoints: about three runs.
    useful = sched.max_num_seqs * sum(
        3 * g.spec.pages_per_state
        if isinstance(g.spec, LinearStateSpec)
        else -(-sched.max_model_len // g.spec.block_size)
        for g in plan.groups
    )
    num_blocks = min(
        max(0, memory.available_bytes - slack_bytes(plan)) // plan.bytes_per_block, useful
    )
    if num_blocks < 2:
        raise ValueError(
            f"the model does not fit: no room for the KV cache ({memory.source}; one block "
            f"needs {plan.bytes_per_block} bytes). Raise gpu_memory_utilization, lower "
            "max_num_batched_tokens / max_num_seqs, use more tensor-parallel ranks, or set "
            "kv_cache_memory_bytes / num_kv_blocks"
        )
    return num_blocks
