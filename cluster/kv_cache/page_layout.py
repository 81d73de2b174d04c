"""How the one block pool maps onto device memory, so memory really flows between groups.

A pool block id names one page in each of `num_buffers` shared buffers. Layer i of every
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
from dataclasses import dataclass

from kvloom.cluster.kv_cache.spec import PAGE_ALIGN, KVCacheGroup, KVCacheSpec, LinearStateSpec

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


@dataclass
class PageLayout:
    """`num_buffers` shared buffers of `page_bytes` per block; `buffer_of[layer key]` is
    the shared buffer a layer views."""

    page_bytes: int
    num_buffers: int
    buffer_of: dict

    @property
    def bytes_per_block(self) -> int:
        return self.page_bytes * self.num_buffers

    def padding_fraction(self, groups: list[KVCacheGroup], dcp_size: int) -> float:
        """Share of the shared pages no group uses (padding)."""
        used = sum(rank_page_bytes(g.spec, dcp_size) * len(g.layer_names) for g in groups)
        return 1.0 - used / (self.bytes_per_block * len(groups))


def plan_layout(groups: list[KVCacheGroup], dcp_size: int) -> PageLayout:
    page = max(rank_page_bytes(g.spec, dcp_size) for g in groups)
    buffer_of = {}
    for group in groups:
        for i, layer in enumerate(group.layer_names):
            buffer_of[layer] = i
    num_buffers = max(len(g.layer_names) for g in groups)
    return PageLayout(align_up(page, PAGE_ALIGN), num_buffers, buffer_of)


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
