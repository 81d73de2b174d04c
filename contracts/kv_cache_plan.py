"""KV-cache planning between the planes, as vLLM's engine core plans it with its workers:

1. every worker reports what its cache-owning layers keep (`KVCacheSpecs`);
2. the control plane (cluster/kv_cache/planner.py) groups the layers, picks the block size
   and lays the groups out on shared page buffers (`KVCachePlan`);
3. every worker reports the memory it can give the cache under that plan
   (`KVCacheMemory`); the control plane turns the smallest into a block count;
4. the workers allocate the plan's pages for that many blocks.

The choices (groups, block size, page size, which buffer a layer's pages live in) are made
once, by the planner; a worker only follows the plan (workers/cache_pages.py makes the
typed views into the pages).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloom.contracts.kv_cache_spec import KVCacheGroup, KVCacheSpec

# The block size of reported specs: a placeholder, the planner sets the real one.
REPORTED_BLOCK_SIZE = 1


@dataclass
class KVCacheSpecs:
    """What one worker's layers cache, by layer key (the keys its layers answer to; the
    drafter's never collide with the target model's). Specs carry the layers' own
    dtypes and `REPORTED_BLOCK_SIZE` tokens per block."""

    target: dict[int, KVCacheSpec]
    draft: dict[int, KVCacheSpec] = field(default_factory=dict)


@dataclass
class PageLayout:
    """Where a pool block's pages live on a rank: `num_buffers` shared buffers of
    `page_bytes` per block, the target model's layer `key` viewing buffer
    `buffer_of[key]`; a drafter layer has private pages of `private_page_bytes[key]`."""

    page_bytes: int
    num_buffers: int
    buffer_of: dict
    private_page_bytes: dict = field(default_factory=dict)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one pool block costs on a rank: a page in every shared buffer, plus the
        drafter's private pages."""
        return self.page_bytes * self.num_buffers + sum(self.private_page_bytes.values())


@dataclass
class KVCachePlan:
    """The control plane's plan for every worker's cache.

    `block_size`: tokens per pool block, over all decode-context-parallel ranks (each rank
    holds `block_size / dcp_size` of them). `groups`: the KV-cache groups, the target
    model's first, each spec at the chosen block size; a drafter layer joins a target group
    with its spec or a group of its own. `layout`: the pages of each layer."""

    block_size: int
    groups: list[KVCacheGroup]
    layout: PageLayout

    @property
    def layer_to_group(self) -> dict:
        return {layer: g for g, group in enumerate(self.groups) for layer in group.layer_names}

    @property
    def bytes_per_block(self) -> int:
        return self.layout.bytes_per_block


@dataclass(frozen=True)
class KVCacheMemory:
    """Bytes a worker can give the KV cache, and where that figure comes from (it is
    quoted when the cache does not fit)."""

    available_bytes: int
    source: str
